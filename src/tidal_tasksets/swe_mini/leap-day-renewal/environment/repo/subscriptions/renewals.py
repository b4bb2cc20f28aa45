"""Renewal dates of yearly and monthly subscriptions."""

import calendar
from datetime import date


def add_years(d, years):
    """The same calendar day `years` later (or earlier, for negative `years`).

    29 February becomes 28 February in years that have no 29 February.
    """
    return d.replace(year=d.year + years)


def add_months(d, months):
    """The same day `months` later, clamped to the end of shorter months
    (31 January + 1 month is 28 or 29 February)."""
    index = d.year * 12 + (d.month - 1) + months
    year, month0 = divmod(index, 12)
    last_day = calendar.monthrange(year, month0 + 1)[1]
    return date(year, month0 + 1, min(d.day, last_day))


def renewal_dates(start, count, every="year"):
    """The next `count` renewal dates after `start`; each is counted from `start`, not
    from the previous renewal (so a plan started on 31 January renews on 31 March)."""
    if every == "year":
        step = add_years
    elif every == "month":
        step = add_months
    else:
        raise ValueError(f"unknown period {every!r}")
    return [step(start, n) for n in range(1, count + 1)]
