"""Warehouse stock and purchasing."""
