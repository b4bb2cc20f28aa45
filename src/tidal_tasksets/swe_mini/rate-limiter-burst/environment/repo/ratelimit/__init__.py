"""Rate limiting for the API gateway."""
