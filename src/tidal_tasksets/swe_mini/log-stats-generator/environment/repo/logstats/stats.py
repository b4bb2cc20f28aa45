"""Statistics over log lines like '2024-05-01T12:00:00 ERROR db: connection lost'."""

from collections import Counter, namedtuple

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ERROR_LEVELS = ("ERROR", "CRITICAL")

Entry = namedtuple("Entry", "timestamp level source message")


def parse_line(line):
    """An Entry, or None for a malformed line."""
    parts = line.strip().split(" ", 2)
    if len(parts) != 3 or parts[1] not in LEVELS or ": " not in parts[2]:
        return None
    source, message = parts[2].split(": ", 1)
    return Entry(parts[0], parts[1], source, message)


def entries(lines):
    for line in lines:
        entry = parse_line(line)
        if entry is not None:
            yield entry


def error_rate(lines):
    """The fraction of well-formed lines at ERROR or CRITICAL (0.0 for none)."""
    total = sum(1 for _ in entries(lines))
    if total == 0:
        return 0.0
    errors = sum(1 for e in entries(lines) if e.level in ERROR_LEVELS)
    return errors / total


def level_counts(lines):
    counts = dict.fromkeys(LEVELS, 0)
    for e in entries(lines):
        counts[e.level] += 1
    return counts


def summarize(lines):
    """{'total', 'levels', 'error_rate', 'top_error_source'} for the dashboard."""
    counts = level_counts(lines)
    sources = Counter(e.source for e in entries(lines) if e.level in ERROR_LEVELS)
    return {
        "total": sum(counts.values()),
        "levels": counts,
        "error_rate": error_rate(lines),
        "top_error_source": sources.most_common(1)[0][0] if sources else None,
    }
