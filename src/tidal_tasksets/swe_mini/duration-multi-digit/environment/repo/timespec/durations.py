"""Durations such as '90s', '1h30m' or '2d 4h'."""

import re

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d)([dhms])")


def parse_duration(text):
    """Seconds in a duration: '<number><unit>' parts (units d, h, m, s; spaces between
    parts allowed), or a bare number of seconds. Raises ValueError for anything else."""
    compact = text.strip().lower().replace(" ", "")
    if not compact:
        raise ValueError("empty duration")
    if compact.isdigit():
        return int(compact)
    total, pos = 0, 0
    for match in _PART.finditer(compact):
        if match.start() != pos:
            raise ValueError(f"bad duration: {text!r}")
        total += int(match.group(1)) * UNITS[match.group(2)]
        pos = match.end()
    if pos != len(compact):
        raise ValueError(f"bad duration: {text!r}")
    return total


def format_duration(seconds):
    """The shortest text for `seconds`: 5400 -> '1h30m', 0 -> '0s'."""
    if seconds < 0:
        raise ValueError("negative duration")
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in UNITS.items():
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
