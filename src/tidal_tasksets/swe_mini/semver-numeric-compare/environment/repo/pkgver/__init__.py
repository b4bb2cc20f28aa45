"""Semantic versions."""
