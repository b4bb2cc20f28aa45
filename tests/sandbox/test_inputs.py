"""Bad input fails early with a clear error; custom images."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.sandbox import (
    ExecStatus,
    ImageError,
    Limits,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
)


def test_missing_or_unusable_image(config: SandboxConfig, tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="does not exist"):
        Sandbox(config, image=str(tmp_path / "nope")).start()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ImageError, match="not a directory"):
        Sandbox(config, image=str(f)).start()
    with pytest.raises(ImageError, match="host's root"):
        Sandbox(config, image="/").start()
    bad = tmp_path / "a,b"
    bad.mkdir()
    with pytest.raises(ImageError, match="overlayfs"):
        Sandbox(config, image=str(bad)).start()


@pytest.mark.parametrize("cmd", [42, None, b"ls", {"cmd": "ls"}, ["ls", 3], ("ls", b"-l")])
def test_command_must_be_str_or_list_of_str(sb: Sandbox, cmd: object) -> None:
    with pytest.raises(TypeError, match="must be a str"):
        sb.exec(cmd)  # type: ignore[arg-type]


@pytest.mark.parametrize("cmd", ["", "   ", [], [""], "echo \0"])
def test_empty_or_nul_commands(sb: Sandbox, cmd: object) -> None:
    with pytest.raises(ValueError):
        sb.exec(cmd)  # type: ignore[arg-type]


def test_bad_exec_arguments(sb: Sandbox) -> None:
    for t in (0, -1, float("nan"), "5"):
        with pytest.raises(ValueError, match="timeout"):
            sb.exec("true", timeout=t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="env"):
        sb.exec("true", env={"A=B": "x"})
    with pytest.raises(SandboxPathError, match="not a directory"):
        sb.exec("true", cwd="/nonexistent")
    with pytest.raises(SandboxPathError, match="escapes"):
        sb.exec("true", cwd="../../..")
    with pytest.raises(TypeError):
        sb.exec("cat", stdin=123)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["../../etc/shadow", "/../etc/shadow", "/root/../../x",
                                  "a/../../../../b"])
def test_paths_escaping_with_dotdot(sb: Sandbox, path: str) -> None:
    for op in (sb.read_file, sb.list, lambda p: sb.write_file(p, "x")):
        with pytest.raises(SandboxPathError, match="escapes the sandbox root"):
            op(path)


def test_symlink_escapes_and_absolute_links(sb: Sandbox) -> None:
    sb.exec("ln -s ../../../../../../etc/shadow /root/esc; ln -s ../../.. /root/up; "
            "ln -s /etc/hostname /root/abs; ln -s loop2 /root/loop1; ln -s loop1 /root/loop2")
    with pytest.raises(SandboxPathError, match="through symlink /root/esc"):
        sb.read_file("esc")
    with pytest.raises(SandboxPathError, match="escapes"):
        sb.write_file("up/etc/x", "x")
    with pytest.raises(SandboxPathError, match="escapes"):
        sb.list("up")
    assert sb.read_file("abs") == b"sandbox\n"  # an absolute link means the sandbox's path
    with pytest.raises(SandboxPathError, match="too many symlinks"):
        sb.read_file("loop1")


@pytest.mark.parametrize("path", [b"/etc/passwd", 7, None, "", "a\0b"])
def test_path_type_errors(sb: Sandbox, path: object) -> None:
    with pytest.raises(SandboxPathError):
        sb.read_file(path)  # type: ignore[arg-type]


def test_proc_and_dev_are_not_files_of_the_layer(sb: Sandbox) -> None:
    for p in ("/proc/self/environ", "/proc", "/dev/null"):
        with pytest.raises(SandboxPathError, match="not part of the sandbox's files"):
            sb.read_file(p)
    with pytest.raises(SandboxPathError):
        sb.write_file("/dev/x", "x")


def test_file_api_limits_and_types(config: SandboxConfig) -> None:
    with Sandbox(config, limits=Limits(file_bytes=1000)) as sb:
        sb.exec("head -c 5000 /dev/zero > big; mkfifo fifo")
        with pytest.raises(SandboxPathError, match="read limit"):
            sb.read_file("big")
        with pytest.raises(SandboxPathError, match="not a regular file"):
            sb.read_file("fifo")
        with pytest.raises(TypeError):
            sb.write_file("x", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="mode"):
            sb.write_file("x", "y", mode=0o77777)
        with pytest.raises(FileNotFoundError):
            sb.write_file("no/such/dir/x", "y", mkdirs=False)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        Limits(memory_bytes=-1)
    with pytest.raises(TypeError):
        Limits(pids="many")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SandboxConfig(allow_ports=(70000,))
    with pytest.raises(ValueError):
        SandboxConfig(workdir="relative")
    with pytest.raises(ValueError):
        SandboxConfig(env={"": "x"})


def test_custom_image_without_a_shell(config: SandboxConfig, image: Path) -> None:
    with Sandbox(config, image=str(image)) as sb:
        assert sb.read_text("/data/hello.txt") == "hello from the image\n"
        assert [e.name for e in sb.list("/")] == ["data", "etc", "root"]  # workdir made
        with pytest.raises(SandboxError, match="neither /bin/bash nor /bin/sh"):
            sb.exec("echo hi")
        r = sb.exec(["/bin/true"])
        assert r.status is ExecStatus.NONZERO_EXIT and r.exit_code == 127
        assert "No such file" in r.stderr
        r = sb.exec(["/data/hello.txt"])
        assert r.exit_code == 126
        sb.write_file("/data/new.txt", "layer")
    assert not (image / "data" / "new.txt").exists()  # the image stays read-only
