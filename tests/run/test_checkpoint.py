"""The run's checkpoint survives a kill at any point of its save."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.run.checkpoint import RunState, find_checkpoint, load_state, save_checkpoint


class _Trainer:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def save(self, out: Path) -> None:
        (out / "weights.txt").write_text(self.tag)


def test_a_half_removed_old_checkpoint_does_not_block_the_next_save(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _Trainer("1"), RunState(step=1))
    # a kill during the cleanup of the previous save: checkpoint.old half removed
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "weights.txt").write_text("0")
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint"
    save_checkpoint(tmp_path, _Trainer("2"), RunState(step=2))
    ckpt = find_checkpoint(tmp_path)
    assert ckpt == tmp_path / "checkpoint" and not (tmp_path / "checkpoint.old").exists()
    assert load_state(ckpt).step == 2 and (ckpt / "weights.txt").read_text() == "2"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 2
