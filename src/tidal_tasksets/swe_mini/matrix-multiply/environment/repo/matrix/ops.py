"""Small dense matrices, represented as lists of rows (lists of numbers)."""


def shape(m):
    """(rows, cols); ValueError for an empty or ragged matrix."""
    if not m or not m[0]:
        raise ValueError("empty matrix")
    cols = len(m[0])
    if any(len(row) != cols for row in m):
        raise ValueError("ragged matrix")
    return len(m), cols


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def transpose(m):
    rows, cols = shape(m)
    return [[m[i][j] for i in range(rows)] for j in range(cols)]


def add(a, b):
    if shape(a) != shape(b):
        raise ValueError(f"cannot add {shape(a)} and {shape(b)} matrices")
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def scale(m, k):
    shape(m)
    return [[k * x for x in row] for row in m]


def multiply(a, b):
    """The matrix product a . b (a is r x k, b is k x c; the result is r x c)."""
    raise NotImplementedError("multiply is not implemented yet")


def power(m, n):
    """m multiplied by itself n times (n >= 0; power(m, 0) is the identity)."""
    rows, cols = shape(m)
    if rows != cols:
        raise ValueError("only square matrices have powers")
    if n < 0:
        raise ValueError("negative powers are not supported")
    result = identity(rows)
    for _ in range(n):
        result = multiply(result, m)
    return result
