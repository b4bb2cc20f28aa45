"""Busy and free time. A slot is (start, end) in minutes since midnight, start < end."""


def overlaps(a, b):
    """True if two slots share some time (slots that only touch do not overlap)."""
    return a[0] < b[1] and b[0] < a[1]


def merge_slots(slots):
    """The fewest disjoint slots covering the same time, sorted by start; overlapping
    or touching slots merge."""
    raise NotImplementedError("merge_slots is not implemented yet")


def free_slots(busy, day_start=0, day_end=24 * 60, min_length=1):
    """Free gaps of at least `min_length` minutes within [day_start, day_end]."""
    free = []
    cursor = day_start
    for start, end in merge_slots(busy):
        if end <= day_start or start >= day_end:
            continue
        if start - cursor >= min_length:
            free.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= min_length:
        free.append((cursor, day_end))
    return free


def fmt(minutes):
    return f"{minutes // 60:02d}:{minutes % 60:02d}"
