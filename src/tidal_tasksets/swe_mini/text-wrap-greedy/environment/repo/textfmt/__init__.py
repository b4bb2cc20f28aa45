"""Plain-text report formatting."""

from textfmt.wrap import center, fill, indent, wrap

__all__ = ["center", "fill", "indent", "wrap"]
