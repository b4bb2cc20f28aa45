"""Monitoring dashboard helpers."""
