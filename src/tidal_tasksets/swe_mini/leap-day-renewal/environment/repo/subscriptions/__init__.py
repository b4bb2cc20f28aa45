"""Subscription renewal dates."""
