"""The internal HTTP client."""
