"""A grid of cells; '.' is empty."""

import copy

EMPTY = "."


class Board:
    def __init__(self, rows=3, cols=3):
        self.rows, self.cols = rows, cols
        self.grid = [[EMPTY] * cols for _ in range(rows)]

    def place(self, row, col, mark):
        if self.grid[row][col] != EMPTY:
            raise ValueError(f"cell ({row}, {col}) is taken")
        self.grid[row][col] = mark

    def clone(self):
        """An independent copy: moves on the copy never change this board."""
        other = copy.copy(self)
        other.grid = list(self.grid)
        return other

    def empty_cells(self):
        return [(r, c) for r in range(self.rows) for c in range(self.cols)
                if self.grid[r][c] == EMPTY]

    def _lines(self):
        yield from self.grid
        yield from ([self.grid[r][c] for r in range(self.rows)] for c in range(self.cols))
        if self.rows == self.cols:
            yield [self.grid[i][i] for i in range(self.rows)]
            yield [self.grid[i][self.cols - 1 - i] for i in range(self.rows)]

    def winner(self):
        """The mark that fills a whole row, column or diagonal, or None."""
        for line in self._lines():
            if line[0] != EMPTY and all(cell == line[0] for cell in line):
                return line[0]
        return None

    def render(self):
        return "\n".join("".join(row) for row in self.grid)
