"""URL helpers."""
