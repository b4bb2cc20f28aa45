"""The named recipes in configs/: each parses, and each starts (`prepare_run`, then every
component it names resolved: tasks, harnesses, sandbox runtime, engine, trainer layout).

configs/vllm.toml needs .venv-vllm (CI builds it); it is marked `vllm`, as every test
that needs that venv is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.run.cli import prepare_run
from tidal.run.config import RunConfig, load_config
from tidal.run.loop import resolve

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
NAMED = ("default", "laptop-real", "swe-mini", "two-ranks", "vllm")


def test_the_named_recipes_are_there() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.toml")) == sorted(NAMED)


def test_default_is_what_no_config_gives() -> None:
    assert load_config(CONFIGS / "default.toml") == load_config(None) == RunConfig()


def test_examples_point_at_configs() -> None:
    """The paths issues and docs named before configs/ existed still work."""
    for name in ("laptop-real", "swe-mini"):
        old = ROOT / "examples" / f"{name}.toml"
        assert old.resolve() == (CONFIGS / f"{name}.toml").resolve()


@pytest.mark.parametrize("name", [
    "default", "laptop-real", "two-ranks",
    pytest.param("vllm", marks=pytest.mark.vllm),
])
def test_recipe_parses_and_starts(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  ) -> None:
    monkeypatch.chdir(ROOT)  # vllm.toml names .venv-vllm relative to the checkout
    if name == "vllm" and not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.fail(".venv-vllm is missing: run .ci/vllm-venv.sh (make test does)")
    prepared = prepare_run(CONFIGS / f"{name}.toml", tmp_path / "run", resume=False)
    got = resolve(prepared.cfg)
    assert got.tasks.train and got.tasks.heldout
    assert (got.base_dir / "config.json").is_file()


def test_swe_mini_parses_and_starts_with_a_model(tmp_path: Path) -> None:
    """swe-mini names a placeholder checkpoint (`/path/to/your/instruct-checkpoint`):
    that is refused by name; with a real one (tiny here) it starts."""
    from tidal.run.cli import RunInputError

    path = CONFIGS / "swe-mini.toml"
    with pytest.raises(RunInputError, match="instruct-checkpoint"):
        prepare_run(path, tmp_path / "run", resume=False)
    cfg = load_config(path)
    got = resolve(cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": "tiny"})}))
    assert len(got.tasks.train) == 26 and len(got.tasks.heldout) == 8
    assert (got.base_dir / "config.json").is_file()
