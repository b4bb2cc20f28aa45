"""The computer player."""


def _winning_cell(board, mark):
    for row, col in board.empty_cells():
        trial = board.clone()
        trial.place(row, col, mark)
        if trial.winner() == mark:
            return row, col
    return None


def best_move(board, mark, opponent):
    """Win if possible, else block the opponent's win, else the first empty cell."""
    move = _winning_cell(board, mark) or _winning_cell(board, opponent)
    if move is not None:
        return move
    cells = board.empty_cells()
    return cells[0] if cells else None
