"""A tiny option parser."""
