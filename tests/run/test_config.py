"""The run config: defaults, unknown keys, impossible values, and docs that cover it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from tidal.run.config import ConfigError, RunConfig, dump_config, load_config

DOCS = Path(__file__).parents[2] / "docs" / "config.md"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_default_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = load_config(None)
    assert load_config(_write(tmp_path, dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[rollout]\nworkerz = 3\n", r"rollout\.workerz: unknown key"),
        ("colour = 1\n", r"colour: unknown key"),
        ("[rl]\nsteps = -1\n", r"rl\.steps: Input should be greater than or equal to 0"),
        ("[rl]\ncorrection = 'magic'\n", r"rl\.correction"),
        ("[tasks]\nname = 'chess'\n", "tasks.name 'chess' is not a built-in task set"),
        ("[rl]\nsteps = 0\n[warmstart]\nsteps = 0\n", "nothing to do"),
        ("[model]\ndevice = 'tpu'\n", r"model\.device"),
        ("[rollout\n", "not valid TOML"),
        ("[schedule]\npolicy = 'async'\ndevices = 2\ntrain_devices = 2\n",
         r"schedule\.train_devices \(2\) must leave a rollout device"),
        ("[schedule]\npolicy = 'fifo'\n", r"schedule\.policy"),
        ("[rl]\nnumerics = 'exact'\n", r"rl\.numerics"),
        ("[rl]\nnumerics = 'consistent'\n[rollout]\ntemperature = 0.7\n",
         "needs rollout.temperature = 1.0"),
        ("[rl]\nnumerics = 'consistent'\n[train]\nmatmul_dtype = 'auto'\n",
         "needs train.matmul_dtype = \"float32\""),
        ("[train]\nmatmul_dtype = 'float16'\n", r"train\.matmul_dtype"),
        ("[schedule]\nbackend = 'ray'\n[engine]\nkind = 'vllm'\n",
         r"schedule\.backend = \"ray\" runs the embedded engine on every host"),
        ("[schedule]\nbackend = 'slurm'\n", r"schedule\.backend 'slurm' is neither a "
         r"built-in \(local, ray\)"),
    ],
)
def test_bad_config_is_refused_with_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(Path("/nonexistent/tidal.toml"))


def test_every_field_is_documented() -> None:
    doc = DOCS.read_text()
    cfg = RunConfig()
    for name, section in cfg:
        if isinstance(section, BaseModel):
            assert f"[{name}]" in doc
            for key, _ in section:
                assert re.search(rf"^{key} = ", doc, re.M), f"{name}.{key} undocumented"
        else:
            assert re.search(rf"^{name} = ", doc, re.M)


@pytest.mark.parametrize("name", ["laptop-real.toml", "swe-mini.toml"])
def test_the_example_configs_load(name: str) -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / name)
    if name == "laptop-real.toml":  # `make run-real`: a real model, real tasks, a warm start
        assert (cfg.model.name, cfg.tasks.source) == ("smollm2-135m", "shell-skills")
        assert cfg.warmstart.steps > 0 and cfg.warmstart.teacher == "exact"
        assert cfg.rollout.tools == ("bash", "read_file", "write_file", "finish")
        assert (cfg.tasks.train_size, cfg.tasks.heldout_size) == (240, 64)
        # bf16 matmuls where oneDNN runs them, a bf16 KV cache (docs/agent.md)
        assert (cfg.engine.matmul_dtype, cfg.engine.kv_dtype) == ("auto", "bfloat16")
        assert cfg.train.matmul_dtype == "auto"  # the trainer's too (docs/agent.md)
    assert "run-real" in (root / "Makefile").read_text()
