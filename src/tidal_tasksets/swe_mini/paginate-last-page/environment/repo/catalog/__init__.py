"""Product catalog helpers."""

from catalog.pagination import Page, PageError, page_count, paginate

__all__ = ["Page", "PageError", "page_count", "paginate"]
