"""Split a product listing into numbered pages (page numbers start at 1)."""

from dataclasses import dataclass


class PageError(ValueError):
    """A page number outside 1..total_pages."""


@dataclass
class Page:
    number: int
    items: list
    total_pages: int

    @property
    def has_next(self):
        return self.number < self.total_pages

    @property
    def has_previous(self):
        return self.number > 1


def page_count(total_items, per_page):
    """How many pages `total_items` items fill at `per_page` items a page.

    An empty listing still has one (empty) page.
    """
    if per_page < 1:
        raise ValueError("per_page must be at least 1")
    return max(1, total_items // per_page)


def paginate(items, page, per_page=10):
    """The `page`-th page (1-based) of `items`."""
    pages = page_count(len(items), per_page)
    if not 1 <= page <= pages:
        raise PageError(f"page {page} out of range 1..{pages}")
    start = (page - 1) * per_page
    return Page(page, list(items[start:start + per_page]), pages)
