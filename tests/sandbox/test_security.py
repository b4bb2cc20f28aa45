"""Invariant 6: nothing the agent runs reaches the host or the network unless allowed."""

from __future__ import annotations

import http.server
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tidal.sandbox import Sandbox, SandboxConfig

CONNECT = ("python3 -c 'import socket,sys; s=socket.create_connection((sys.argv[1], "
           "int(sys.argv[2])), timeout=3); s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\"); "
           "print(s.recv(100).split(b\"\\r\\n\")[0].decode())' {host} {port}")


@pytest.fixture
def host_secret(tmp_path: Path) -> Path:
    """A stand-in for the ledger store: a host file the agent must never see."""
    p = tmp_path / "ledger.db"
    p.write_text("SECRET-LEDGER-CONTENT")
    return p


@pytest.fixture
def gateway() -> Iterator[int]:
    """A stand-in for the gateway: an HTTP server on the host's loopback."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"gateway")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cannot_read_host_files(sb: Sandbox, host_secret: Path) -> None:
    r = sb.exec(f"cat {host_secret}; cat /etc/shadow; ls -A /root /home; ls /root/.pyenv")
    assert "SECRET" not in r.stdout
    assert r.stdout.strip() == "/home:\n\n/root:" or r.stdout.split() == ["/home:", "/root:"]
    assert "No such file" in r.stderr
    assert not sb.exec(f"test -e {host_secret.parent}").ok
    assert not sb.exec("test -e /work").ok and not sb.exec("test -e /usr/local/etc/npmrc").ok
    for path in (str(host_secret), "/etc/shadow", "/root/.bashrc"):
        with pytest.raises(FileNotFoundError):
            sb.read_file(path)
    # A symlink made inside points inside: never at the host's file.
    sb.exec(f"ln -s {host_secret} /root/l1; ln -s /etc/shadow /root/l2")
    for link in ("l1", "l2"):
        with pytest.raises(FileNotFoundError):
            sb.read_file(link)
    assert "SECRET" not in sb.exec("cat /root/l1 /root/l2").stdout


def test_etc_holds_no_private_files(sb: Sandbox) -> None:
    etc = {e.name for e in sb.list("/etc")}
    assert {"passwd", "group", "hosts", "ld.so.cache"} <= etc
    assert not etc & {"shadow", "gshadow", "ssh", "sudoers", "machine-id", "ssl/private"}
    assert sb.read_text("/etc/passwd").count("\n") == 2  # ours, not the host's list


def test_cannot_reach_pid1_or_host_processes(sb: Sandbox) -> None:
    ps = sb.exec("ps -e -o pid=,comm=").stdout.split("\n")
    assert len([p for p in ps if p.strip()]) <= 4, ps  # init, the shell, ps
    r = sb.exec(f"kill -0 {os.getpid()}")
    assert r.exit_code != 0
    r = sb.exec("ls /proc/1/root; cat /proc/1/environ; cat /proc/1/maps")
    assert r.stdout == "" and r.stderr.count("Permission denied") == 3, r


def test_no_capabilities_no_privilege_gain(sb: Sandbox) -> None:
    status = sb.exec("grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status").stdout
    assert "CapEff:\t0000000000000000" in status and "CapPrm:\t0000000000000000" in status
    assert "NoNewPrivs:\t1" in status
    assert not sb.exec("mount -t tmpfs none /mnt").ok
    assert not sb.exec("unshare -U true").ok  # no nested user namespaces
    assert not sb.exec("unshare -n true").ok
    assert not sb.exec("chroot / true").ok


def test_cannot_write_outside_its_layer(sb: Sandbox, tmp_path: Path) -> None:
    # Writes to the image land in the layer, never in the host's directories.
    assert sb.exec("echo evil > /usr/bin/tidal-evil && echo x > /etc/tidal-evil").ok
    assert not Path("/usr/bin/tidal-evil").exists() and not Path("/etc/tidal-evil").exists()
    host_file = tmp_path / "host.txt"
    sb.exec(f"ln -s {host_file} /root/out")
    sb.write_file("out", "via symlink")  # follows the link inside the sandbox
    assert not host_file.exists()
    assert sb.exec(f"cat {host_file}").stdout == "via symlink"
    # Kernel knobs: /proc/sys is read-only (uid 0 inside maps to the host's root).
    r = sb.exec("v=$(cat /proc/sys/vm/dirty_writeback_centisecs); "
                "echo $v > /proc/sys/vm/dirty_writeback_centisecs")
    assert r.exit_code != 0 and "Read-only" in r.stderr
    assert not sb.exec("echo 1 > /proc/sysrq-trigger").ok
    assert not sb.exec("ls /sys/fs/cgroup").ok
    assert sb.exec("ls /dev").stdout.split() == [
        "core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
        "stdout", "tty", "urandom", "zero"]


def test_no_network_and_no_gateway_unless_allowed(config: SandboxConfig, gateway: int) -> None:
    with Sandbox(config) as sb:
        r = sb.exec("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 3)'")
        assert r.exit_code != 0 and "unreachable" in r.stderr
        r = sb.exec(CONNECT.format(host="127.0.0.1", port=gateway))
        assert r.exit_code != 0 and "refused" in r.stderr
        assert sb.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1").stdout.split() == ["lo"]
    other = _free_port()
    with Sandbox(replace(config, allow_ports=(gateway,))) as sb:
        r = sb.exec(CONNECT.format(host="127.0.0.1", port=gateway))
        assert r.ok and r.stdout.startswith("HTTP/1.0 200"), r
        r = sb.exec(CONNECT.format(host="localhost", port=gateway))
        assert r.ok, r
        r = sb.exec(CONNECT.format(host="127.0.0.1", port=other))  # not on the list
        assert r.exit_code != 0 and "refused" in r.stderr
        r = sb.exec("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 3)'")
        assert r.exit_code != 0


def test_deleting_image_files_only_hides_them_in_the_layer(sb: Sandbox, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.write_text("alive")
    assert Path("/usr/share/doc").is_dir()
    r = sb.exec(f"rm -rf /usr/share/doc {canary} /etc/hosts; ls /usr/share/doc")
    assert r.exit_code != 0 and "No such file" in r.stderr
    assert Path("/usr/share/doc").is_dir() and canary.read_text() == "alive"
    assert Path("/etc/hosts").exists()


def test_env_reaches_only_the_command(sb: Sandbox, tmp_path: Path) -> None:
    """bwrap runs as the host's root: an LD_PRELOAD meant for the command must not be
    loaded by bwrap from the host's filesystem."""
    lib = tmp_path / "evil.so"
    lib.write_bytes(b"not a library")  # the host's loader would say "file too short"
    r = sb.exec("echo $LD_PRELOAD", env={"LD_PRELOAD": str(lib)})
    assert r.stdout == f"{lib}\n"
    assert "cannot open shared object file" in r.stderr  # looked for inside, not there
    assert "file too short" not in r.stderr
