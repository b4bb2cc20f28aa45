"""Sandbox tests need root, bubblewrap, overlayfs and (for the limit tests) cgroup v1:
what `.ci/sandbox-deps.sh` sets up on CI. Elsewhere they skip with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidal.sandbox import Limits, Sandbox, SandboxConfig, SandboxUnavailableError
from tidal.sandbox.cgroups import v1_available
from tidal.sandbox.local import require_available

try:
    require_available()
    _WHY = ""
except SandboxUnavailableError as e:
    _WHY = str(e)

needs_sandbox = pytest.mark.skipif(bool(_WHY), reason=_WHY)
_CG_OK, _CG_WHY = v1_available()
needs_cgroups = pytest.mark.skipif(not _CG_OK, reason=_CG_WHY)

# Small, safe limits for a shared 2-core machine.
SMALL = Limits(memory_bytes=128 << 20, pids=64, cpu_s=5.0, wall_s=30.0,
               output_bytes=64 * 1024, disk_bytes=64 << 20, file_bytes=1 << 20)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here) and _WHY:
            item.add_marker(pytest.mark.skip(reason=_WHY))


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sandbox-state")
    os.chmod(d, 0o700)  # noqa: PTH101
    return d


@pytest.fixture
def config(state_dir: Path) -> SandboxConfig:
    return SandboxConfig(limits=SMALL, state_dir=str(state_dir))


@pytest.fixture
def sb(config: SandboxConfig) -> Iterator[Sandbox]:
    with Sandbox(config) as s:
        yield s


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A tiny custom image: a directory with a few files and no shell."""
    img = tmp_path / "image"
    (img / "data").mkdir(parents=True)
    (img / "data" / "hello.txt").write_text("hello from the image\n")
    (img / "etc").mkdir()
    (img / "etc" / "motd").write_text("image motd\n")
    return img
