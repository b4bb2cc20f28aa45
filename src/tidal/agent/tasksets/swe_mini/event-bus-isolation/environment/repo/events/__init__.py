"""In-process events."""
