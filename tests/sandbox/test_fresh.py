"""The verifier's sandbox (`Sandbox.fresh`) and ending the agent (`kill_processes`): what
a task's grader runs in once the agent is done (issue 51). Everything here asserts on a
real bubblewrap sandbox, from inside it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tidal.sandbox import Sandbox, SandboxConfig, SandboxStateError


def _app_layer(tmp_path: Path) -> str:
    """A prebuilt layer holding the task's /app as its image has it."""
    layer = tmp_path / "layer"
    app = layer / "root" / "app"
    (app / "docs").mkdir(parents=True)
    (app / "old.txt").write_text("from the image\n")
    (app / "docs" / "keep.md").write_text("image doc\n")
    (app / "config.ini").write_text("debug=false\n")
    return str(layer)


@pytest.fixture
def app_config(config: SandboxConfig, tmp_path: Path) -> SandboxConfig:
    return replace(config, workdir="/app", layers=(_app_layer(tmp_path),))


def test_fresh_carries_the_workdir_as_left_and_nothing_else(app_config: SandboxConfig) -> None:
    sb = Sandbox(app_config).start()
    sb.exec("mv old.txt new.txt && rm docs/keep.md && echo 'debug=true' > config.ini && "
            "mkdir -p out/deep && echo result > out/deep/r.txt && ln -s /usr/bin/env envlink "
            "&& ln out/deep/r.txt /root/outside-link && echo planted > /tmp/x")
    sb.exec("printf '#!/bin/sh\\necho 2\\n' > /usr/bin/grep && chmod +x /usr/bin/grep && "
            "mkdir -p /usr/local/bin && cp /usr/bin/grep /usr/local/bin/python3 && "
            "echo 'PATH=/tmp:$PATH' >> /etc/profile && rm /usr/bin/tail")
    assert sb.exec("grep -c x /dev/null").stdout == "2\n"
    with sb.fresh(["/app"]) as v:
        assert sb.closed
        assert v.log == ()  # nothing replays: a new sandbox
        r = v.exec("ls -A /app /app/docs; cat config.ini out/deep/r.txt; readlink envlink; "
                   "grep -c x /dev/null; python3 -c 'print(7)'; ls -A /tmp /root | wc -w; "
                   "grep -c tmp /etc/profile; command -v tail")
        assert r.stdout == (
            "/app:\nconfig.ini\ndocs\nenvlink\nnew.txt\nout\n\n/app/docs:\n"
            "debug=true\nresult\n/usr/bin/env\n0\n7\n2\n0\n/usr/bin/tail\n"), r.stderr
        assert v.read_text("/app/new.txt") == "from the image\n"


def test_fresh_kills_what_the_agent_left_running(app_config: SandboxConfig) -> None:
    sb = Sandbox(app_config).start()
    sb.exec("(setsid sh -c 'while :; do echo 1 > /app/reward.txt; sleep 0.01; done' &) ; "
            "(nohup sleep 1000 >/dev/null 2>&1 &)")
    with sb.fresh([]) as v:  # nothing carried: the image as it was
        assert v.exec("ls -A /app; ps -e -o comm=").stdout == (
            "config.ini\ndocs\nold.txt\ninit\nps\n")


def test_fresh_leaves_out_a_path_whose_parent_became_a_symlink(
        config: SandboxConfig, tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "root" / "home" / "u" / "app").mkdir(parents=True)
    (layer / "root" / "home" / "u" / "app" / "f.txt").write_text("image\n")
    cfg = replace(config, workdir="/home/u/app", layers=(str(layer),))
    sb = Sandbox(cfg).start()
    sb.exec("mkdir -p /tmp/fake/app && echo forged > /tmp/fake/app/f.txt && cd / && "
            "rm -rf /home/u && ln -s /tmp/fake /home/u")
    assert sb.read_text("/home/u/app/f.txt") == "forged\n"
    with sb.fresh(["/home/u/app"]) as v:
        assert v.read_text("/home/u/app/f.txt") == "image\n"  # never read through the link


def test_fresh_keeps_a_path_in_another_mount_and_whole_mounts_under_one(
        config: SandboxConfig) -> None:
    sb = Sandbox(replace(config, workdir="/srv")).start()
    sb.exec("mkdir -p /usr/local/share/t && echo u > /usr/local/share/t/u.txt && "
            "echo s > /srv/s.txt && echo e > /etc/e.txt")
    with sb.fresh(["/usr/local/share/t", "/srv"]) as v:
        assert v.exec("cat /usr/local/share/t/u.txt /srv/s.txt; test -e /etc/e.txt || echo no"
                      ).stdout == "u\ns\nno\n"
    sb = Sandbox(config).start()
    sb.exec("mkdir -p /usr/local/t && echo u > /usr/local/t/u.txt && echo e > /etc/e.txt")
    with sb.fresh(["/"]) as v:  # everything: the agent's files, none of its processes
        assert v.exec("cat /usr/local/t/u.txt /etc/e.txt").stdout == "u\ne\n"


def test_kill_processes_leaves_the_sandbox_usable(sb: Sandbox) -> None:
    sb.exec("(setsid sleep 1000 &) ; (sh -c 'while :; do sleep 1 & wait; done' &)")
    assert sb.kill_processes() >= 2
    assert sb.exec("ps -e -o comm=").stdout == "init\nps\n"
    assert sb.kill_processes() == 0
    sb.close()
    with pytest.raises(SandboxStateError):
        sb.kill_processes()
