"""Bank statement import."""
