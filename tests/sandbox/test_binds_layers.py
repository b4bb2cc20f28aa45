"""`SandboxConfig.binds` (host paths read-only inside) and `SandboxConfig.layers`
(prebuilt read-only layers stacked over the image), with real sandboxes."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from tidal.sandbox import Bind, ImageError, Sandbox, SandboxConfig
from tidal.sandbox.image import OPAQUE_XATTR
from tidal.sandbox.local import LocalRuntime

# --------------------------------------------------------------------------- binds


@pytest.fixture
def harness(tmp_path: Path) -> Path:
    h = tmp_path / "harness"
    (h / "pkg").mkdir(parents=True)
    (h / "pkg" / "agent.py").write_text("print('agent')\n")
    return h


def test_bind_is_readable_read_only_and_alone(config: SandboxConfig, harness: Path,
                                              tmp_path: Path) -> None:
    single = tmp_path / "token.txt"
    single.write_text("one file\n")
    cfg = replace(config, binds=(Bind(str(harness), "/opt/harness"),
                                 Bind(str(single), "/etc/token.txt")))
    before = sorted(p.name for p in harness.rglob("*"))
    with Sandbox(cfg) as sb:
        r = sb.exec("python3 /opt/harness/pkg/agent.py; cat /etc/token.txt")
        assert r.stdout == "agent\none file\n", r.stderr
        for cmd in ("echo x > /opt/harness/pkg/agent.py", "touch /opt/harness/new",
                    "rm /opt/harness/pkg/agent.py", "echo y > /etc/token.txt"):
            r = sb.exec(cmd)
            assert r.exit_code != 0 and "Read-only file system" in r.stderr, cmd
        # nothing else of the host: the same / as without binds, only the mount points
        top = sb.exec(f"ls -A /; test -e {harness.parent} || echo no-parent").stdout
        assert sb.exec("ls -A /opt").stdout == "harness\n"
        assert sb.list("/opt/harness") == []  # the file API sees the empty mount point
    with Sandbox(config) as plain:
        assert top == plain.exec("ls -A /").stdout + "no-parent\n"
    assert sorted(p.name for p in harness.rglob("*")) == before
    assert (harness / "pkg" / "agent.py").read_text() == "print('agent')\n"
    assert single.read_text() == "one file\n"


@pytest.mark.parametrize(("entry", "message"), [
    ("/nope/missing:/opt/x", "does not exist"),
    ("relative:/opt/x", "absolute"),
    ("{h}:relative", "absolute sandbox path"),
    ("{h}:/", "cannot be /"),
    ("{h}:/proc/x", "under /proc"),
    ("{h}:/dev", "under /dev"),
    ("{h}:/opt/../etc", "not normalized"),
    ("{h}", "HOST:SANDBOX"),
    ("{h}:/a:/b", "HOST:SANDBOX"),
    ("{h}:/opt/x:rw", "read-only"),
])
def test_bind_parse_errors_name_the_entry(harness: Path, entry: str, message: str) -> None:
    entry = entry.format(h=harness)
    with pytest.raises(ValueError, match=message) as e:
        Bind.parse(entry)
    assert repr(entry) in str(e.value)


def test_bind_parse_and_round_trip(config: SandboxConfig, harness: Path) -> None:
    b = Bind.parse(f"{harness}:/opt/h")
    assert b == Bind(str(harness), "/opt/h") == Bind.parse(f"{harness}:/opt/h:ro")
    cfg = replace(config, binds=(b,))
    assert SandboxConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="share a target"):
        replace(config, binds=(b, Bind(str(harness), "/opt/h")))
    with pytest.raises(TypeError):
        replace(config, binds=(f"{harness}:/opt/h",))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- layers


def make_layer(root: Path) -> Path:
    """A hand-made layer over the default image: a new file, a whiteout hiding
    /etc/hostname, an opaque /etc/skel."""
    layer = root / "layer"
    etc = layer / "root" / "etc"
    (etc / "skel").mkdir(parents=True)
    (etc / "from-layer.txt").write_text("layer file\n")
    os.mknod(etc / "hostname", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (etc / "skel" / "only").write_text("x\n")
    os.setxattr(etc / "skel", OPAQUE_XATTR, b"y")
    (layer / "usr" / "share" / "tidal-test").mkdir(parents=True)
    (layer / "usr" / "share" / "tidal-test" / "u.txt").write_text("usr layer\n")
    return layer


def test_layers_stack_over_the_image(config: SandboxConfig, tmp_path: Path) -> None:
    layer = make_layer(tmp_path)
    upper = tmp_path / "upper"
    (upper / "root" / "etc").mkdir(parents=True)
    (upper / "root" / "etc" / "from-layer.txt").write_text("upper layer wins\n")
    cfg = replace(config, layers=(str(upper), str(layer)))
    with Sandbox(cfg) as sb:
        r = sb.exec("cat /etc/from-layer.txt /usr/share/tidal-test/u.txt; "
                    "test -e /etc/hostname || echo hidden; ls -A /etc/skel; echo w > /etc/new")
        assert r.stdout == "upper layer wins\nusr layer\nhidden\nonly\n", r.stderr
        assert sb.read_text("/etc/new") == "w\n"
    assert not (layer / "root" / "etc" / "new").exists()  # writes go to the episode's layer
    assert not (upper / "root" / "etc" / "new").exists()


def test_layers_validation_and_round_trip(config: SandboxConfig, tmp_path: Path,
                                          image: Path) -> None:
    layer = make_layer(tmp_path)
    cfg = replace(config, layers=(str(layer),))
    assert SandboxConfig.from_dict(cfg.to_dict()) == cfg
    assert LocalRuntime().image_id(cfg) == f"default+{layer}"
    bad = tmp_path / "a,b"
    bad.mkdir()
    for layers, message in (((str(tmp_path / "missing"),), "not an existing directory"),
                            (("relative",), "absolute"), ((str(bad),), "overlayfs")):
        with pytest.raises(ValueError, match=message):
            replace(config, layers=layers)
    with pytest.raises(ImageError, match="does not mount"), Sandbox(  # built for another image
            replace(config, image=str(image), layers=(str(layer),))):
        pass


def test_snapshot_restores_on_the_same_layers_and_binds(config: SandboxConfig, tmp_path: Path,
                                                        harness: Path) -> None:
    layer = make_layer(tmp_path)
    cfg = replace(config, layers=(str(layer),), binds=(Bind(str(harness), "/opt/harness"),))
    with Sandbox(cfg) as sb:
        assert sb.exec("echo mine > /etc/mine").ok
        snap = sb.snapshot(tmp_path / "ep.snap")
    assert snap.config == cfg and str(layer) in snap.meta["image"]
    sb2 = Sandbox.restore(snap, strict=False)
    try:
        r = sb2.exec("cat /etc/mine /etc/from-layer.txt; ls /opt/harness; "
                     "test -e /etc/hostname || echo hidden")
        assert r.stdout == "mine\nlayer file\npkg\nhidden\n", r.stderr
    finally:
        sb2.close()
