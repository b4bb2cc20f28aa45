"""Durations for the scheduler's config."""
