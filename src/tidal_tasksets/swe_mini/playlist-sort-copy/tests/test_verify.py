import unittest

from playlist.playlist import Playlist, Track


def sample():
    return Playlist([Track("Intro", "Zed", 300), Track("Short", "Amy", 90),
                     Track("Middle", "Bo", 200), Track("Also short", "Cy", 90)])


def titles(tracks):
    return [t.title for t in tracks]


class VerifyPlaylist(unittest.TestCase):
    def test_by_duration(self):
        self.assertEqual(titles(sample().by_duration()),
                         ["Short", "Also short", "Middle", "Intro"])

    def test_by_duration_leaves_playlist(self):
        pl = sample()
        pl.by_duration()
        self.assertEqual(titles(pl.tracks), ["Intro", "Short", "Middle", "Also short"])

    def test_by_duration_returns_a_copy(self):
        pl = sample()
        view = pl.by_duration()
        view.clear()
        self.assertEqual(len(pl.tracks), 4)

    def test_play_order_survives_sorting(self):
        pl = sample()
        first = pl.next_track()
        pl.by_duration()
        pl.longest(2)
        self.assertEqual((first.title, pl.next_track().title, pl.next_track().title),
                         ("Intro", "Short", "Middle"))

    def test_longest(self):
        self.assertEqual(titles(sample().longest(2)), ["Intro", "Middle"])
        self.assertEqual(titles(sample().longest(4)), ["Intro", "Middle", "Short", "Also short"])

    def test_longest_leaves_playlist(self):
        pl = sample()
        pl.longest()
        self.assertEqual(titles(pl.tracks), ["Intro", "Short", "Middle", "Also short"])

    def test_by_artist(self):
        self.assertEqual(titles(sample().by_artist()), ["Short", "Middle", "Also short", "Intro"])

    def test_next_track_wraps(self):
        pl = Playlist([Track("a", "x", 1), Track("b", "x", 1)])
        self.assertEqual(titles([pl.next_track() for _ in range(3)]), ["a", "b", "a"])
        self.assertIsNone(Playlist().next_track())

    def test_total_seconds(self):
        self.assertEqual(sample().total_seconds(), 680)


if __name__ == "__main__":
    unittest.main()
