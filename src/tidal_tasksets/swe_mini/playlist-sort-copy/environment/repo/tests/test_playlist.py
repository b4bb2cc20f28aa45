import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from playlist.playlist import Playlist, Track


def sample():
    return Playlist([Track("Intro", "Zed", 300), Track("Short", "Amy", 90),
                     Track("Middle", "Bo", 200)])


class PlaylistTest(unittest.TestCase):
    def test_by_duration(self):
        self.assertEqual([t.title for t in sample().by_duration()],
                         ["Short", "Middle", "Intro"])

    def test_play_order_survives_sorting(self):
        pl = sample()
        pl.by_duration()
        self.assertEqual(pl.next_track().title, "Intro")


if __name__ == "__main__":
    unittest.main()
