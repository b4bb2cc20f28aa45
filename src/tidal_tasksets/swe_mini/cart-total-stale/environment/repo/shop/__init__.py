"""The web shop."""
