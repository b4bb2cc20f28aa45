"""Retrying flaky network calls."""
