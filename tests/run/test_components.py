"""Components by name: built-ins and module:attr for every seam, resolved in one place,
with errors that name the config key; and the run config's new sections."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.harbor_tasks import write_task
from tidal.agent.command import CommandHarness
from tidal.agent.episode import EpisodeContext, FunctionHarness, HarnessResult
from tidal.agent.harness import AgentConfig, BuiltinHarness
from tidal.agent.tasks import FileChecks, FileExists, Task, TaskSet, files_taskset
from tidal.run import components, names
from tidal.run.config import ConfigError, RunConfig, dump_config, load_config, parse_config

TASKS = [Task(f"t{i}", f"do {i}", FileChecks((FileExists("x"),))) for i in range(6)]


class UserHarness:
    def run(self, ctx: EpisodeContext) -> HarnessResult:
        return HarnessResult("complete")


def user_fn(ctx: EpisodeContext) -> HarnessResult | None:
    return None


@pytest.fixture
def user_module() -> Iterator[str]:
    """A user's module, importable by name, as their own package would be."""
    mod = types.ModuleType("tidal_user_mod")
    mod.TASKS = TASKS  # type: ignore[attr-defined]
    mod.make_tasks = lambda seed: TASKS[: 3 + seed]  # type: ignore[attr-defined]
    mod.taskset = lambda seed: TaskSet("u", tuple(TASKS[:4]), tuple(TASKS[4:]))  # type: ignore[attr-defined]
    mod.UserHarness = UserHarness  # type: ignore[attr-defined]
    mod.user_fn = user_fn  # type: ignore[attr-defined]
    mod.nothing = 3  # type: ignore[attr-defined]
    mod.no_seed = lambda: TASKS  # type: ignore[attr-defined]
    sys.modules["tidal_user_mod"] = mod
    yield "tidal_user_mod"
    del sys.modules["tidal_user_mod"]


def _cfg(**sections: dict[str, object]) -> RunConfig:
    return parse_config(dict(sections))


def test_module_attr_loads_and_says_what_is_missing(user_module: str) -> None:
    assert names.load_attr(f"{user_module}:TASKS", "k") is TASKS
    with pytest.raises(names.ComponentError, match=r"k 'nope_mod:x': cannot import"):
        names.load_attr("nope_mod:x", "k")
    with pytest.raises(names.ComponentError, match="has no attribute 'missing'"):
        names.load_attr(f"{user_module}:missing", "k")
    assert names.is_attr("a.b:c.d") and not names.is_attr("./tasks")
    assert not names.is_attr("/srv/tasks") and not names.is_attr("files")


def test_task_sources_resolve_from_builtins_directories_and_module_attr(
    user_module: str, tmp_path: Path
) -> None:
    def select(source: str, heldout: str = "", **kw: int) -> components.Tasks:
        cfg = _cfg(tasks={"source": source, "heldout_source": heldout, **kw})
        return components.select_tasks(cfg.tasks, seed=kw.get("seed_", 0))

    files = select("files")  # a built-in set keeps its own split
    assert [t.task_id for t in files.heldout] == [t.task_id for t in files_taskset().heldout]
    swe = select("swe-mini", heldout_size=8)
    assert len(swe.heldout) == 8 and len(swe.train) >= 22
    assert not {t.task_id for t in swe.train} & {t.task_id for t in swe.heldout}
    assert [t.task_id for t in select(f"{user_module}:taskset").heldout] == ["t4", "t5"]
    split = select(f"{user_module}:TASKS", heldout_size=2)
    assert len(split.heldout) == 2 and len(split.train) == 4
    assert split == select(f"{user_module}:TASKS", heldout_size=2)  # the same seeded split
    assert len(select(f"{user_module}:make_tasks", heldout_size=1).train) == 2  # seed=0: 3
    for i in range(3):
        write_task(tmp_path / "mine", f"task-{i}")
    mine = select(str(tmp_path / "mine"), heldout=f"{user_module}:TASKS", train_size=2)
    assert [t.task_id for t in mine.train] == ["task-0", "task-1"] and len(mine.heldout) == 6
    with pytest.raises(names.ComponentError, match="leaves none to train on"):
        select(str(tmp_path / "mine"), heldout_size=3)
    with pytest.raises(names.ComponentError, match=r"in both tasks\.source and"):
        select(f"{user_module}:TASKS", heldout=f"{user_module}:TASKS")
    with pytest.raises(names.ComponentError, match="must give a TaskSet or a non-empty"):
        select(f"{user_module}:nothing")
    with pytest.raises(names.ComponentError, match=r"calling it as factory\(seed=\.\.\.\) "
                       "failed: .*unexpected keyword argument 'seed'"):
        select(f"{user_module}:no_seed")


def test_a_generated_set_and_a_split_directory_keep_their_own_split(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(tasks={"source": "shell-skills", "train_size": 1000, "heldout_size": 1000})
    skills = components.select_tasks(cfg.tasks, seed=0)
    assert (len(skills.train), len(skills.heldout)) == (240, 64)
    assert {t.family for t in skills.heldout} == {t.family for t in skills.train}
    assert all(t.solution and t.environment is not None for t in skills.train)
    assert (tmp_path / "cache" / "tasksets").is_dir()  # generated into the cache, once
    for split, name in (("train", "a"), ("train", "b"), ("heldout", "c")):
        write_task(tmp_path / "mine" / split, name)
    mine = components.select_tasks(_cfg(tasks={"source": str(tmp_path / "mine"),
                                               "heldout_size": 5}).tasks, seed=0)
    assert [t.task_id for t in mine.train] == ["a", "b"]
    assert [t.task_id for t in mine.heldout] == ["c"]


def test_harnesses_resolve_by_name(user_module: str) -> None:
    agent = AgentConfig()
    assert isinstance(components.make_harness(_cfg(), agent), BuiltinHarness)
    cmd = components.make_harness(
        _cfg(agent={"harness": "command", "command": "run-agent", "env": {"A": "1"}},
             warmstart={"steps": 0}), agent)
    assert isinstance(cmd, CommandHarness) and cmd.env == {"A": "1"}
    cls = components.make_harness(_cfg(agent={"harness": f"{user_module}:UserHarness"},
                                       warmstart={"steps": 0}), agent)
    assert isinstance(cls, UserHarness)
    fn = components.make_harness(_cfg(agent={"harness": f"{user_module}:user_fn"},
                                      warmstart={"steps": 0}), agent)
    assert isinstance(fn, FunctionHarness) and fn.fn is user_fn


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"tasks": {"source": ""}}, "tasks.source is empty"),
        ({"tasks": {"name": "chess"}}, "tasks.name 'chess' is not a built-in task set"),
        ({"tasks": {"name": "files", "source": "digits"}}, "disagree"),
        ({"agent": {"harness": "command"}}, "needs agent.command"),
        ({"agent": {"harness": "claude"}}, "agent.harness 'claude' is neither a built-in"),
        ({"agent": {"command": "x"}}, "only used with agent.harness"),
        ({"agent": {"mounts": ["relative:/opt"]}}, "agent.mounts"),
        ({"agent": {"harness": "command", "command": "x"}}, "set warmstart.steps = 0"),
        ({"rollout": {"sandbox": "podman"}}, "rollout.sandbox 'podman' is neither"),
        ({"rollout": {"sandbox": "docker"}, "warmstart": {"steps": 0},
          "agent": {"harness": "command", "command": "x"}},
         r"cannot run agent\.harness = \"command\""),
        ({"rollout": {"sandbox": "docker"}, "environment": {"fallback": "default"}},
         r"environment\.fallback is for rollout\.sandbox = \"bwrap\""),
        ({"rollout": {"sandbox": "docker"}, "environment": {"images": {"ubuntu": "default"}}},
         r"maps 'ubuntu' to \"default\""),
        ({"engine": {"kind": "vllm-magic"}}, "engine.kind"),
        ({"schedule": {"backend": "slurm"}}, "schedule.backend"),
        ({"environment": {"imagez": {}}}, r"environment\.imagez: unknown key"),
    ],
)
def test_bad_components_are_refused_naming_the_key(
    sections: dict[str, dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(sections)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ({"source": "/nowhere/tasks"}, "tasks.source '/nowhere/tasks' is not a"),
        ({"heldout_source": "chess"}, "tasks.heldout_source 'chess' is not a"),
    ],
)
def test_a_missing_task_directory_parses_and_is_refused_at_run_start(
    tasks: dict[str, object], message: str
) -> None:
    """A saved config parses on any machine: the directory is looked for when the run
    starts, and its absence named there."""
    cfg = parse_config({"tasks": tasks})  # type: ignore[dict-item]
    with pytest.raises(names.ComponentError, match=message):
        components.select_tasks(cfg.tasks, cfg.seed)


def test_the_older_tasks_name_reads_and_new_sections_round_trip(tmp_path: Path) -> None:
    assert parse_config({"tasks": {"name": "digits"}}).tasks.source == "digits"
    cfg = _cfg(agent={"harness": "command", "command": "mini -t \"$TIDAL_INSTRUCTION\"",
                      "mounts": [f"{tmp_path}:/opt/a"], "env": {"K": "v \"q\""},
                      "timeout_sec": 30.0},
               environment={"images": {"ubuntu:24.04": "default"}, "fallback": "default"},
               warmstart={"steps": 0})
    p = tmp_path / "c.toml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_trainer_under_torchrun_must_match_its_world_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's WORLD_SIZE and `train.world_size` must agree (nothing starts)."""
    cfg = parse_config({"train": {"world_size": 2}, "rollout": {"tasks_per_step": 2}})
    spec = components.trainer_spec(cfg, tmp_path, None, device="cpu")
    assert (spec.world_size, spec.state_dir, spec.lora) == (2, None, None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(names.ComponentError, match=r"train\.world_size = 2 but "
                       r"torchrun started 3 ranks"):
        components.make_trainer(spec, run_dir=tmp_path)


def test_lora_round_trips_through_the_saved_config(tmp_path: Path) -> None:
    cfg = parse_config({"train": {"lora": {"r": 4, "targets": ["q_proj"]}}})
    p = tmp_path / "c.toml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg and cfg.train.lora is not None
    assert "lora" not in dump_config(parse_config({}))  # absent stays absent


def test_a_user_runtime_factory_is_checked_when_it_yields(user_module: str,
                                                          tmp_path: Path) -> None:
    """`rollout.sandbox = "module:attr"`: a context manager of a ToolRuntime; one that
    yields something else is named, with what it lacks."""
    import contextlib

    from tidal.agent.runtime import LocalDirRuntime
    from tidal.sandbox import SandboxConfig

    class Partial:  # a runtime from before snapshots were part of the protocol
        def exec(self, command: str, timeout_s: float) -> None: ...

    mod = sys.modules[user_module]
    mod.good = lambda config: contextlib.nullcontext(LocalDirRuntime(tmp_path))  # type: ignore[attr-defined]
    mod.bad = lambda config: contextlib.nullcontext(Partial())  # type: ignore[attr-defined]
    with components.make_runtime_factory(f"{user_module}:good")(SandboxConfig()) as rt:
        rt.write_file("a.txt", "hi")
        assert rt.read_file("a.txt") == "hi" and not rt.can_snapshot
    bad = components.make_runtime_factory(f"{user_module}:bad")(SandboxConfig())
    with pytest.raises(names.ComponentError,
                       match=r"gave a Partial, not a ToolRuntime .*lacks read_file, "
                             r"write_file, list, upload, can_snapshot, snapshot"), bad:
        pass


def test_the_embedded_engines_batch_cap_is_a_config_key() -> None:
    """`engine.max_batch_size` reaches the embedded engine (its decode steps run that many
    sequences at most); with another engine kind it is refused, naming the key."""
    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.tiny import ensure_tiny

    tiny_dir = ensure_tiny()
    cfg = parse_config({"engine": {"max_batch_size": 48}})
    engine = components.make_engine(cfg, tiny_dir, device="cpu", policy_version=0,
                                    model_name="m", tokenizer_dir=tiny_dir,
                                    run_dir=tiny_dir)
    try:
        assert isinstance(engine, EmbeddedEngine) and engine.max_batch_size == 48
    finally:
        engine.close()
    with pytest.raises(ConfigError, match=r"engine.max_batch_size is only used with "
                                          r"engine.kind = \"embedded\" \(kind is 'vllm'\)"):
        parse_config({"engine": {"kind": "vllm", "max_batch_size": 48}})
    with pytest.raises(ConfigError, match="max_batch_size"):
        parse_config({"engine": {"max_batch_size": 0}})


@pytest.mark.parametrize("key", ["matmul_dtype", "kv_dtype"])
def test_engine_bf16_keys_are_refused_by_name(key: str) -> None:
    """`engine.matmul_dtype` and `engine.kv_dtype` are refused by name with another engine
    kind, with the consistent numerics, and for a dtype they do not know."""
    with pytest.raises(ConfigError, match=rf"engine.{key} is only used with "
                                          r"engine.kind = \"embedded\" \(kind is 'vllm'\)"):
        parse_config({"engine": {"kind": "vllm", key: "bfloat16"}})
    with pytest.raises(ConfigError, match=r"rl.numerics = \"consistent\" needs "
                                          rf"engine.{key} = \"float32\""):
        parse_config({"engine": {key: "bfloat16"}, "rl": {"numerics": "consistent"}})
    with pytest.raises(ConfigError, match=key):
        parse_config({"engine": {key: "float16"}})


def test_engine_matmul_dtype_auto() -> None:
    """`engine.matmul_dtype = "auto"` (kv_dtype has no auto) is taken for the embedded engine
    with the standard numerics and refused by name elsewhere, as bfloat16 is."""
    assert parse_config({"engine": {"matmul_dtype": "auto"}}).engine.matmul_dtype == "auto"
    with pytest.raises(ConfigError, match=r"engine.matmul_dtype is only used with "
                                          r"engine.kind = \"embedded\""):
        parse_config({"engine": {"kind": "vllm", "matmul_dtype": "auto"}})
    with pytest.raises(ConfigError, match=r"needs engine.matmul_dtype = \"float32\" "
                                          r"\(got 'auto'\)"):
        parse_config({"engine": {"matmul_dtype": "auto"}, "rl": {"numerics": "consistent"}})
    with pytest.raises(ConfigError, match="kv_dtype"):
        parse_config({"engine": {"kv_dtype": "auto"}})


def test_engine_bf16_keys_reach_the_embedded_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.kv_dtype` (any CPU) and `engine.matmul_dtype` (where oneDNN runs bf16)
    reach the embedded engine's decode step; where this CPU has no bf16 matmuls the
    engine's refusal names the kind and the reason."""
    import torch

    from tidal.engine import fused
    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.tiny import ensure_tiny

    tiny_dir = ensure_tiny()
    both = fused.bf16_matmuls()
    cfg = parse_config({"engine": {"kv_dtype": "bfloat16",
                                   "matmul_dtype": "bfloat16" if both else "float32"}})
    engine = components.make_engine(cfg, tiny_dir, device="cpu", policy_version=0,
                                    model_name="m", tokenizer_dir=tiny_dir, run_dir=tiny_dir)
    try:
        assert isinstance(engine, EmbeddedEngine)
        decoder = fused.fast_decoder(engine.model)
        assert decoder is not None and decoder.kv_dtype == torch.bfloat16
        assert decoder.matmul_dtype == (torch.bfloat16 if both else torch.float32)
    finally:
        engine.close()
    cfg = parse_config({"engine": {"matmul_dtype": "bfloat16"}})
    monkeypatch.setattr(fused, "bf16_matmuls", lambda: False)
    with pytest.raises(names.ComponentError,
                       match=r"engine.kind = \"embedded\": matmul_dtype bfloat16: oneDNN "
                             r"runs no bf16 matmuls"):
        components.make_engine(cfg, tiny_dir, device="cpu", policy_version=0, model_name="m",
                               tokenizer_dir=tiny_dir, run_dir=tiny_dir)
