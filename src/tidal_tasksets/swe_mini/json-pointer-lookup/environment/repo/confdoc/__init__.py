"""Config documents."""
