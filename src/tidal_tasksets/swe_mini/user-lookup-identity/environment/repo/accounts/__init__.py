"""The user directory behind the user API."""
