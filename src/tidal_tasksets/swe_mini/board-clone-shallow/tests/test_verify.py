import unittest

from gridgame.ai import best_move
from gridgame.board import Board


def board_from(text):
    rows = text.split()
    board = Board(len(rows), len(rows[0]))
    for r, row in enumerate(rows):
        for c, mark in enumerate(row):
            if mark != ".":
                board.place(r, c, mark)
    return board


class VerifyGame(unittest.TestCase):
    def test_winner_row_column_diagonal(self):
        self.assertEqual(board_from("XXX ... ...").winner(), "X")
        self.assertEqual(board_from("O.. O.. O..").winner(), "O")
        self.assertEqual(board_from("X.. .X. ..X").winner(), "X")
        self.assertIsNone(board_from("XO. ... ...").winner())

    def test_place_taken_cell(self):
        board = board_from("X.. ... ...")
        with self.assertRaises(ValueError):
            board.place(0, 0, "O")

    def test_clone_is_independent(self):
        board = Board()
        copy = board.clone()
        copy.place(0, 0, "O")
        self.assertEqual(board.render(), "...\n...\n...")
        board.place(2, 2, "X")
        self.assertEqual(copy.render(), "O..\n...\n...")

    def test_clone_keeps_contents(self):
        board = board_from("X.O .X. ...")
        self.assertEqual(board.clone().render(), board.render())

    def test_best_move_leaves_board_alone(self):
        board = board_from("X.. ... ...")
        best_move(board, "O", "X")
        self.assertEqual(board.render(), "X..\n...\n...")
        self.assertEqual(len(board.empty_cells()), 8)

    def test_takes_the_win(self):
        board = board_from("OO. XX. ...")
        self.assertEqual(best_move(board, "O", "X"), (0, 2))

    def test_blocks_the_opponent(self):
        board = board_from("X.. X.. .O.")
        self.assertEqual(best_move(board, "O", "X"), (2, 0))

    def test_first_empty_cell_otherwise(self):
        board = board_from("X.. ... ...")
        self.assertEqual(best_move(board, "O", "X"), (0, 1))

    def test_full_board(self):
        board = board_from("XOX XOO OXX")
        self.assertIsNone(best_move(board, "O", "X"))


if __name__ == "__main__":
    unittest.main()
