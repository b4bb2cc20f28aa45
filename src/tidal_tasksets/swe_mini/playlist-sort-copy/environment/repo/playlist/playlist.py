"""A playlist plays its tracks in the order they were added, wrapping around."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Track:
    title: str
    artist: str
    seconds: int


class Playlist:
    def __init__(self, tracks=None):
        self.tracks = list(tracks or [])
        self._position = 0

    def add(self, track):
        self.tracks.append(track)

    def next_track(self):
        """The next track to play (None for an empty playlist)."""
        if not self.tracks:
            return None
        track = self.tracks[self._position % len(self.tracks)]
        self._position += 1
        return track

    def by_duration(self):
        """A new list of the tracks, shortest first (ties keep playlist order)."""
        self.tracks.sort(key=lambda t: t.seconds)
        return self.tracks

    def by_artist(self):
        """A new list of the tracks by artist, then title (case-insensitive)."""
        return sorted(self.tracks, key=lambda t: (t.artist.lower(), t.title.lower()))

    def longest(self, n=1):
        """The `n` longest tracks, longest first (ties keep playlist order)."""
        self.tracks.sort(key=lambda t: t.seconds, reverse=True)
        return self.tracks[:n]

    def total_seconds(self):
        return sum(t.seconds for t in self.tracks)
