"""Log dashboard statistics."""
