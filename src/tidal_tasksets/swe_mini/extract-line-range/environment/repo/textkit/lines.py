"""Line-oriented helpers, like `sed -n START,ENDp`, `head`, `tail` and `cat -n`."""


def split_lines(text):
    return text.splitlines()


def extract_lines(text, start, end=None):
    """Lines `start` through `end` of `text`, 1-based and both inclusive.

    `end=None` means the last line; an `end` past the last line is clamped; a range with
    start > end is empty. A `start` below 1 raises ValueError.
    """
    if start < 1:
        raise ValueError("line numbers start at 1")
    lines = split_lines(text)
    if end is None:
        end = len(lines)
    return lines[start:end]


def head(text, n=10):
    return split_lines(text)[:n]


def tail(text, n=10):
    if n <= 0:
        return []
    return split_lines(text)[-n:]


def number_lines(text, first=1):
    """Each line prefixed with its number, right-aligned like `cat -n`."""
    lines = split_lines(text)
    width = len(str(first + len(lines) - 1)) if lines else 1
    return [f"{i:>{width}}  {line}" for i, line in enumerate(lines, first)]
