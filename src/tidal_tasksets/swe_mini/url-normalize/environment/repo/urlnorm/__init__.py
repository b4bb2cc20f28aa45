"""Canonical URLs for the crawler."""
