"""Blog post helpers."""
