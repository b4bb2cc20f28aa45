"""URL slugs for blog post titles."""

import re

_SEPARATORS = re.compile(r"[^a-z0-9]+")


def slugify(title, max_length=60):
    """Lowercase ASCII words joined by '-' ('Crème brûlée!' -> 'creme-brulee').

    Accented letters keep their base letter; any other character that is not an ASCII
    letter or digit separates words. Slugs longer than `max_length` are cut at a word
    boundary.
    """
    text = title.lower()
    text = _SEPARATORS.sub("-", text).strip("-")
    if len(text) > max_length:
        cut = text[:max_length + 1]
        text = cut.rsplit("-", 1)[0] if "-" in cut else text[:max_length]
    return text


def unique_slug(title, existing):
    """A slug for `title` that is not in `existing`: '-2', '-3', ... are appended on a
    collision; a title with nothing usable in it becomes 'post'."""
    base = slugify(title) or "post"
    slug, n = base, 2
    while slug in existing:
        slug = f"{base}-{n}"
        n += 1
    return slug
