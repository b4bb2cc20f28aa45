"""Thin Linux system-call wrappers the local runtime needs and Python 3.11 lacks:
mount(2), umount2(2), setns(2), the NS_GET_PARENT ioctl, and the sandbox's pid-1
program (a 150-byte static ELF built here, so no image needs to contain anything).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import struct
from collections.abc import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2

CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
NS_GET_PARENT = 0xB702


def _raise(what: str) -> None:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                   data.encode() if data is not None else None) != 0:
        _raise(f"mount {fstype} on {target}")


def umount(target: str) -> None:
    """Lazily unmount `target`; a path that is not mounted is fine."""
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            _raise(f"umount {target}")


def setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        _raise("setns")


def ns_parent(fd: int) -> int:
    """A new fd for the parent of the user namespace `fd` refers to."""
    return int(fcntl.ioctl(fd, NS_GET_PARENT))


@contextlib.contextmanager
def thread_in_namespaces(targets: list[tuple[int, int]]) -> Iterator[None]:
    """Move the calling *thread* (not the process) into the given (fd, type) namespaces
    for the duration of the block. Processes forked meanwhile start inside them; the
    other threads of the process are unaffected. Net, IPC and UTS namespaces allow this
    in a multi-threaded process."""
    names = {CLONE_NEWNET: "net", CLONE_NEWIPC: "ipc", CLONE_NEWUTS: "uts"}
    saved = [(os.open(f"/proc/thread-self/ns/{names[t]}", os.O_RDONLY | os.O_CLOEXEC), t)
             for _, t in targets]
    entered: list[tuple[int, int]] = []
    try:
        for (fd, t) in targets:
            setns(fd, t)
            entered.append((fd, t))
        yield
    finally:
        try:
            for fd, t in saved:
                setns(fd, t)
        finally:
            for fd, _ in saved:
                os.close(fd)


def proc_starttime(pid: int) -> int | None:
    """The start time (clock ticks since boot) of `pid`, or None if it is gone. Pid plus
    start time names a process without the risk of pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # noqa: PTH123
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


# --------------------------------------------------------------------------- pid 1
#
# The sandbox's pid 1 must exist in every image, reap orphans, block forever, and die
# when its owner dies. It is this x86-64 program (assembled with GNU as, then copied
# here as bytes so that no compiler is needed):
#
#   _start: lea rsi,[rip+act]; mov edi,17; xor edx,edx; mov r10d,8; mov eax,13; syscall
#           ; rt_sigaction(SIGCHLD, {SIG_IGN}): the kernel reaps orphans at once
#           mov edi,1; lea rsi,[rip+act]; mov edx,1; mov eax,1; syscall
#           ; write(1, "\x01", 1): "ready"
#   1:      xor edi,edi; lea rsi,[rsp-16]; mov edx,1; xor eax,eax; syscall
#           ; read(0, buf, 1) on the owner's pipe: blocks until the owner goes
#           test rax,rax; jg 1b; cmp rax,-4; je 1b     ; data or EINTR: read again
#           xor edi,edi; mov eax,60; syscall           ; EOF: exit(0), which makes the
#                                                      ; kernel kill the whole pid ns
#   act:    .quad 1, 0, 0, 0                           ; struct sigaction {SIG_IGN}
#
# The runtime installs it execute-only (mode 0111), which makes pid 1 non-dumpable:
# commands inside cannot open /proc/1/root, /proc/1/mem and the like.

_INIT_X86_64 = bytes.fromhex(
    "488d3550000000bf1100000031d241ba08000000b80d0000000f05bf01000000488d3530000000"
    "ba01000000b8010000000f0531ff488d7424f0ba0100000031c00f054885c07feb4883f8fc74e5"
    "31ffb83c0000000f05" + "01" + "00" * 31
)


def init_elf() -> bytes | None:
    """The pid-1 program as a static ELF executable, or None on other architectures."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    base, header_len = 0x400000, 64 + 56
    size = header_len + len(_INIT_X86_64)
    ehdr = struct.pack(
        "<4sBBBB8sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, b"\0" * 8,
        2, 0x3E, 1, base + header_len, 64, 0, 0, 64, 56, 1, 0, 0, 0,
    )
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)
    return ehdr + phdr + _INIT_X86_64
