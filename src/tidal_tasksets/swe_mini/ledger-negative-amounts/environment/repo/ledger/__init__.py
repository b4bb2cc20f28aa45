"""A ledger of amounts in integer cents."""
