"""The meeting planner."""
