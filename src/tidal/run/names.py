"""Components by name: each seam's built-in names, `module:attr` for a user's own, and
the checks a config makes of a name when it is read.

A leaf of `tidal.run`: the config (`tidal.run.config`), the components
(`tidal.run.components`) and the loggers (`tidal.run.loggers`) all import it and none
of them imports another to check a name. Nothing here reads the filesystem or imports a
user's module: a config parses alike on any machine, and what a name points at is
resolved when the run starts (`tidal.run.loop.resolve`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from tidal.agent.harbor import GENERATED_SETS, HARBOR_SETS
from tidal.agent.tasks import TASK_SETS

BUILTIN_TASK_SOURCES: tuple[str, ...] = (*TASK_SETS, *HARBOR_SETS, *GENERATED_SETS)
BUILTINS: dict[str, tuple[str, ...]] = {
    "agent.harness": ("builtin", "command"),
    "rollout.sandbox": ("bwrap", "docker", "local"),
    "engine.kind": ("embedded", "vllm"),
    "schedule.backend": ("local", "ray"),
}
_ATTR = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class ComponentError(ValueError):
    """A component could not be resolved; the message names the config key."""


def is_attr(value: str) -> bool:
    """Whether `value` reads as `module:attr` (not a path: no '/')."""
    return bool(_ATTR.match(value))


def load_attr(spec: str, key: str) -> Any:
    """Import `module:attr.path` for config key `key`."""
    if not is_attr(spec):
        raise ComponentError(f"{key} {spec!r} is not module:attr")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ComponentError(f"{key} {spec!r}: cannot import {mod_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ComponentError(f"{key} {spec!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def check_named(key: str, value: str) -> None:
    """A built-in name of `key`'s seam, or module:attr syntax (imported at run start)."""
    if value not in BUILTINS[key] and not is_attr(value):
        raise ValueError(f"{key} {value!r} is neither a built-in ({', '.join(BUILTINS[key])}) "
                         "nor module:attr")


def check_harness(harness: str, command: str) -> None:
    check_named("agent.harness", harness)
    if harness == "command" and not command.strip():
        raise ValueError("agent.harness = \"command\" needs agent.command (the command line "
                         "to run in the sandbox)")
    if harness != "command" and command.strip():
        raise ValueError(f"agent.command is only used with agent.harness = \"command\" "
                         f"(harness is {harness!r})")


def check_task_source(value: str, key: str) -> None:
    """A task source names a built-in set, `module:attr`, or a directory: the directory
    is looked for when the run starts (`tidal.run.components.select_tasks`)."""
    if not value.strip():
        raise ValueError(f"{key} is empty: name a built-in task set "
                         f"({', '.join(BUILTIN_TASK_SOURCES)}), a directory of Harbor tasks "
                         "or module:attr")
