"""Fuzzing the config files `tidal run` reads (hypothesis): TOML texts built from the
config's own fields (sections, keys, valid values within each field's bounds and its
literal choices), then mutated (values of the wrong type, out of range, huge, `inf`/`nan`,
dates; tables where a value belongs and values where a table belongs; unknown keys),
and texts cut short, spliced with random bytes or not UTF-8 at all, and random texts.

Properties, for every case: `load_config` returns a `RunConfig` or raises `ConfigError`
whose message names the file; never another exception. A config it returns reads back
equal from `dump_config`'s text (what `--resume` reads). Every few cases the same file
also goes through `tidal run`'s own checks (`prepare_run`, in process, which stops before
a model loads): a `Prepared`, or `ConfigError` naming the file, or `RunInputError` naming
`model.name`/`model.device`; and it writes nothing.

Budget: `TIDAL_FUZZ_EXAMPLES` cases per test (default 40); the cases are derandomized
unless `TIDAL_FUZZ_SEED` is set; each test appends its count of cases to
`TIDAL_FUZZ_COUNTS` when set (`tests.fuzzing.record_cases`).
"""

from __future__ import annotations

import datetime as dt
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import annotated_types
import tomli_w
from hypothesis import strategies as st
from pydantic import BaseModel

from tests import fuzzing
from tidal.run.cli import Prepared, RunInputError, prepare_run
from tidal.run.config import (
    INT_MAX,
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
)

DOOR = "config"
PREPARE_EVERY = 5  # every Nth case also runs `prepare_run`

# strings never hold ':' (a module:attr the config would import: `engine.tool_parser`)
TEXT = st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)),
               max_size=12)
SPECIAL_STRINGS = ["", " ", "tiny", "/", "..", "~", "a" * 5000, "\x00", "x" * 300 + "/y",
                   "/tmp:/x", "rel:/x", "no_such_module_zz:attr"]
SCALARS = st.one_of(
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.sampled_from([0, -1, 1, INT_MAX, INT_MAX + 1, -INT_MAX - 1, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.sampled_from(SPECIAL_STRINGS),
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31)),
    st.dates(),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


def toml_text(data: dict[str, Any]) -> str:
    """The data as TOML (tomli-w: top-level values first, then a [table] per dict)."""
    return tomli_w.dumps(data)


# ------------------------------------------------------------------ the config's fields


def sections() -> dict[str, type[BaseModel]]:
    out = {}
    for name, f in RunConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out[name] = f.annotation
    return out


SECTIONS = sections()
DEFAULTS = RunConfig().model_dump(mode="python")


def valid_value(data: st.DataObject, model: type[BaseModel], key: str, default: Any) -> Any:
    """A value the field's own type and bounds take (its literal choices, a number within
    its bounds), or its default."""
    f = model.model_fields[key]
    ann = f.annotation
    if typing.get_origin(ann) is typing.Literal:
        return data.draw(st.sampled_from(typing.get_args(ann)), label=key)
    low = high = None
    for m in f.metadata:
        if isinstance(m, annotated_types.Ge | annotated_types.Gt):
            low = m.ge if isinstance(m, annotated_types.Ge) else m.gt
        if isinstance(m, annotated_types.Le | annotated_types.Lt):
            high = m.le if isinstance(m, annotated_types.Le) else m.lt
    if ann is int:
        lo = int(low) if low is not None else -100
        return data.draw(st.integers(lo, min(int(high) if high is not None else lo + 100,
                                             lo + 100)), label=key)
    if ann is float:
        lo = float(low) if low is not None else 0.0
        return data.draw(st.floats(lo, lo + 100.0, exclude_min=True), label=key)
    if isinstance(default, tuple):
        return list(default)
    return default


def config_data(data: st.DataObject) -> dict[str, Any]:
    """Some sections, some keys, valid values; then 0-3 mutations."""
    out: dict[str, Any] = {}
    if data.draw(st.booleans(), label="seed"):
        out["seed"] = data.draw(st.integers(0, 1000), label="seed value")
    for name in data.draw(st.lists(st.sampled_from(sorted(SECTIONS)), max_size=4, unique=True),
                          label="sections"):
        model = SECTIONS[name]
        keys = data.draw(st.lists(st.sampled_from(sorted(model.model_fields)), max_size=4,
                                  unique=True), label=f"{name} keys")
        values = {k: valid_value(data, model, k, DEFAULTS[name][k]) for k in keys}
        # TOML has no null: a key whose default is None (train.lora) is written by leaving
        # it out
        out[name] = {k: v for k, v in values.items() if v is not None}
    for _ in range(data.draw(st.integers(0, 3), label="mutations")):
        mutate(data, out)
    return out


def mutate(data: st.DataObject, cfg: dict[str, Any]) -> None:
    kind = data.draw(st.sampled_from(["value", "value", "unknown", "table", "scalar section",
                                      "drop"]), label="mutation")
    tables = [k for k, v in cfg.items() if isinstance(v, dict)]
    if kind == "unknown":
        where = data.draw(st.sampled_from([None, *tables]), label="where")
        target = cfg if where is None else cfg[where]
        target[data.draw(TEXT, label="new key") or "x"] = data.draw(VALUES, label="its value")
    elif kind == "scalar section":
        cfg[data.draw(st.sampled_from(sorted(SECTIONS)), label="section")] = data.draw(
            SCALARS, label="scalar")
    elif kind == "drop" and cfg:
        cfg.pop(data.draw(st.sampled_from(sorted(cfg)), label="dropped"))
    elif tables:
        name = data.draw(st.sampled_from(tables), label="table")
        key = data.draw(st.sampled_from(sorted(SECTIONS.get(name, RunConfig).model_fields)),
                        label="key")
        cfg[name][key] = (data.draw(st.dictionaries(TEXT, SCALARS, max_size=2), label="nested")
                          if kind == "table" else data.draw(VALUES, label="wrong value"))


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["cut", "splice", "not utf-8", "duplicate line"]),
                     label="byte mutation")
    at = data.draw(st.integers(0, len(raw)), label="at")
    if kind == "cut":
        return raw[:at]
    if kind == "splice":
        return raw[:at] + data.draw(st.binary(max_size=8), label="bytes") + raw[at:]
    if kind == "not utf-8":
        return raw[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80",
                                                     b"\xfe\xff"]), label="bad") + raw[at:]
    lines = raw.split(b"\n")
    i = data.draw(st.integers(0, len(lines) - 1), label="line")
    return b"\n".join([*lines[: i + 1], lines[i], *lines[i + 1:]])


# ------------------------------------------------------------------ the properties


class Door:
    """Loads each case's file and checks what comes back."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.path = tmp / "case.toml"
        self.cases = 0
        self.loaded = 0

    def check(self, raw: bytes) -> None:
        self.cases += 1
        self.path.write_bytes(raw)
        try:
            cfg = load_config(self.path)
        except ConfigError as e:
            assert str(self.path) in str(e), str(e)
            assert "Traceback" not in str(e)
            cfg = None
        if cfg is not None:
            self.loaded += 1
            assert isinstance(cfg, RunConfig)
            saved = self.tmp / "saved.toml"
            saved.write_text(dump_config(cfg))
            assert load_config(saved) == cfg  # what --resume reads back
        if self.cases % PREPARE_EVERY == 1:
            self.check_prepare()

    def check_prepare(self) -> None:
        out = self.tmp / "run"
        try:
            plan = prepare_run(self.path, out, resume=False, runs=self.tmp / "runs")
        except ConfigError as e:
            assert str(self.path) in str(e), str(e)
        except RunInputError as e:
            assert str(e).startswith(("model.name", "model.device")), str(e)
        else:
            assert isinstance(plan, Prepared) and plan.out == out
        assert not out.exists() and not (self.tmp / "runs").exists()  # nothing written


def run_cases(name: str, case: Callable[[st.DataObject], None]) -> None:
    fuzzing.run_cases(DOOR, name, case)


def test_config_texts_from_the_fields(tmp_path: Path) -> None:
    door = Door(tmp_path)

    def case(data: st.DataObject) -> None:
        door.check(toml_text(config_data(data)).encode())

    door.check(toml_text({"rl": {"steps": 3}}).encode())  # a valid one first: it loads
    assert door.loaded == 1
    run_cases("test_config_texts_from_the_fields", case)


def test_config_bytes_mutated(tmp_path: Path) -> None:
    door = Door(tmp_path)

    def case(data: st.DataObject) -> None:
        raw = toml_text(config_data(data)).encode()
        for _ in range(data.draw(st.integers(1, 3), label="byte mutations")):
            raw = mutate_bytes(data, raw)
        door.check(raw)

    run_cases("test_config_bytes_mutated", case)


def test_random_config_texts(tmp_path: Path) -> None:
    door = Door(tmp_path)
    keys = [*SECTIONS, "seed"]

    def case(data: st.DataObject) -> None:
        raw = data.draw(st.one_of(
            st.binary(max_size=200),
            TEXT.map(str.encode),
            st.lists(st.sampled_from([f"[{k}]" for k in keys] + [f"{k} = 1" for k in keys]
                                     + ["[[rl]]", "a.b.c = 1", "x = [[[[1]]]]", "= 1",
                                        'steps = """', "steps = 0x10", "seed = 1_000"]),
                     max_size=6).map(lambda ls: "\n".join(ls).encode()),
            st.dictionaries(TEXT, VALUES, max_size=4).map(lambda d: toml_text(d).encode()),
            st.just(json.dumps({"rl": {"steps": 3}}).encode()),
            st.just(b"a = " + b"[" * 5000 + b"]" * 5000),
        ), label="text")
        door.check(raw)

    run_cases("test_random_config_texts", case)
