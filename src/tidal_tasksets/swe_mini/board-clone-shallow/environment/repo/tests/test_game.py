import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gridgame.ai import best_move
from gridgame.board import Board


class GameTest(unittest.TestCase):
    def test_winner(self):
        board = Board()
        for col in range(3):
            board.place(1, col, "X")
        self.assertEqual(board.winner(), "X")

    def test_clone_is_independent(self):
        board = Board()
        copy = board.clone()
        copy.place(0, 0, "O")
        self.assertEqual(board.render(), "...\n...\n...")

    def test_best_move_leaves_board_alone(self):
        board = Board()
        board.place(0, 0, "X")
        best_move(board, "O", "X")
        self.assertEqual(board.render(), "X..\n...\n...")


if __name__ == "__main__":
    unittest.main()
