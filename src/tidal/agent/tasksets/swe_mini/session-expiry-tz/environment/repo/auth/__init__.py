"""Login sessions."""
