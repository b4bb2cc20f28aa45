"""Semantic versions: MAJOR.MINOR.PATCH[-prerelease][+build], optional 'v' prefix."""

import re
from functools import total_ordering

_VERSION = re.compile(
    r"^v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?$")


@total_ordering
class Version:
    def __init__(self, text):
        match = _VERSION.match(text.strip())
        if match is None:
            raise ValueError(f"not a semantic version: {text!r}")
        self.text = text.strip()
        self.core = (match.group(1), match.group(2), match.group(3))
        self.pre = tuple(match.group(4).split(".")) if match.group(4) else ()

    def _key(self):
        # A pre-release sorts before its release (1.0.0-rc.1 < 1.0.0); numeric
        # pre-release parts compare as numbers and sort before alphanumeric ones.
        pre = [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre]
        return (self.core, 0 if self.pre else 1, pre)

    def __eq__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self):
        return hash((self.core, self.pre))

    def __repr__(self):
        return f"Version({self.text!r})"


def latest(versions, include_prerelease=False):
    """The text of the newest version (pre-releases skipped unless asked), or None."""
    candidates = [Version(v) for v in versions]
    if not include_prerelease:
        candidates = [v for v in candidates if not v.pre]
    return max(candidates).text if candidates else None


def satisfies(version, minimum):
    return Version(version) >= Version(minimum)
