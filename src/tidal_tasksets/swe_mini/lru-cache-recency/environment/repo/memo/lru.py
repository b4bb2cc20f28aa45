"""A least-recently-used cache and a memoizing decorator built on it."""

import functools
from collections import OrderedDict


class LRUCache:
    """At most `capacity` entries; when full, adding a new key evicts the least recently
    used one. get() and put() both count as a use; `key in cache` does not."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._data = OrderedDict()   # least recently used first
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key in self._data:
            self.hits += 1
            return self._data[key]
        self.misses += 1
        return default

    def put(self, key, value):
        if key not in self._data and len(self._data) >= self.capacity:
            self._data.popitem(last=False)
        self._data[key] = value

    def keys(self):
        return list(self._data)

    def __contains__(self, key):
        return key in self._data

    def __len__(self):
        return len(self._data)


_MISSING = object()


def lru_memoize(capacity):
    """Cache a function's results by its (hashable) positional arguments."""
    def decorate(fn):
        cache = LRUCache(capacity)

        @functools.wraps(fn)
        def wrapper(*args):
            value = cache.get(args, _MISSING)
            if value is _MISSING:
                value = fn(*args)
                cache.put(args, value)
            return value
        wrapper.cache = cache
        return wrapper
    return decorate
