"""Smoothing helpers for dashboard time series."""


def _check_window(window):
    if window < 1:
        raise ValueError("window must be at least 1")


def moving_average(values, window):
    """Simple moving average: the mean of every run of `window` consecutive values.

    One value per complete window; an empty list when there are fewer values than
    `window`.
    """
    _check_window(window)
    result = []
    for start in range(len(values) - window):
        chunk = values[start:start + window]
        result.append(sum(chunk) / window)
    return result


def rolling_max(values, window):
    """The maximum of every run of `window` consecutive values."""
    _check_window(window)
    return [max(values[i:i + window]) for i in range(len(values) - window + 1)]
