"""Word wrapping and simple layout for plain-text reports."""


def wrap(text, width):
    """Greedy word wrap into lines of at most `width` characters (see the README)."""
    raise NotImplementedError("wrap is not implemented yet")


def fill(text, width):
    """`wrap` joined into a single string."""
    return "\n".join(wrap(text, width))


def indent(lines, prefix="    "):
    """Prefix every non-empty line."""
    return [prefix + line if line else line for line in lines]


def center(line, width):
    """Center `line` in `width` columns (extra space goes to the right)."""
    if len(line) >= width:
        return line
    left = (width - len(line)) // 2
    return " " * left + line + " " * (width - len(line) - left)
