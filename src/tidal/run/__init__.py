"""The RL loop that `tidal run` drives (loop.py), its config, rollouts, checkpoints and
report. This is the top of the stack: it wires every other package and adds none of
their logic."""
