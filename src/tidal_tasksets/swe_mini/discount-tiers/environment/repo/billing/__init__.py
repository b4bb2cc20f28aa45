"""Wholesale order pricing."""
