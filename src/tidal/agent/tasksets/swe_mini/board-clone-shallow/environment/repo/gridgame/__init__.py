"""Tic-tac-toe."""
