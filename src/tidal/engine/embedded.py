"""The embedded engine: a transformers causal LM, in process, on CPU or CUDA.

`EmbeddedEngine` loads a checkpoint directory (or "tiny") through `model.py`'s
`load_policy_model` (the trainer's loader too) and serves `generate` calls from any
number of threads through a request queue and a worker thread doing continuous batching:
an idle worker collects what arrives within `batch_wait_s` (up to `max_batch_size`
sequences) into one prefill; while sequences run, queued ones join the running batch at
its next decode step (the fast batch prefills them in that step's forward: `folds`), and
finished ones are returned at once. The batch
itself, and with it the sampling loop and its numerics, is a `DecodeBatch` (`batch.py`),
chosen by `batch_class`: for the models `fused.py` supports on CPU the fast one
(`fast_batch.py`: fused weights, a region KV store, prefill and decode through the same
step), else transformers' forward; this module only queues, admits, and swaps weights.

Semantics shared with the vLLM engine:
- only `SamplingParams.stop_token_ids` stop a sequence (no implicit EOS: the caller, which
  owns the chat template, says what ends a turn); the stop token is included in the output;
- a prompt must be non-empty, of in-vocabulary ids, and shorter than `max_context`;
  generation stops with "length" at `max_tokens` or when the context is full;
- prompt i of a request seeded `s` samples with seed `mix_seed(s, i)`; a seeded request
  gives the same tokens when run again, whoever shares its batch, up to float noise.

`matmul_dtype="bfloat16"` runs the fast step's linear layers with bf16 weights and
inputs (`fused.FastDecoder`), on a CPU where oneDNN multiplies bf16 (`"auto"`: bf16 on
such a CPU, else fp32; `metrics()` says which), and
`kv_dtype="bfloat16"` keeps its KV store (and so the prefix cache) in bf16: half the bytes
a decode step streams, and log-probabilities a bf16 rounding away from the fp32 trainer's,
a mismatch the loss's correction (`rl.correction`) weighs.

`numerics="consistent"` samples from `consistent.py`'s batch-invariant forward instead
(`consistent_batch.py`'s `ConsistentDecodeBatch`, a slot-store KV cache): a token's
logprob is then exactly what the trainer's `attention="consistent"` recomputes.

Weight updates (`update_weights`, given `Weights` from the trainer or a checkpoint
directory) stop admission, let the running sequences finish, then copy the new tensors
into the model in place: a sequence never mixes two policy versions. Tensors in process
never go through a file. The fast batch's step (`fused.py`) keeps fused,
packed copies of the linear weights; they are rebuilt in the same update.

Prefix caching (`prefix_cache_mb`, on by default): the engine owns the `PrefixCache`
(`prefix.py`) its batch keeps finished sequences' KV in, so an agent's call k+1 computes
only the tokens added since call k; it is emptied by every weight update, and off for
models with sliding-window layers. `Generation.extra["cached_tokens"]` says how many
prompt tokens a call read from it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tidal.engine.base import (
    EngineError,
    Generation,
    SamplingParams,
    Weights,
    as_weights,
    mix_seed,
)
from tidal.engine.batch import DecodeBatch, SequenceRequest, SequenceResult
from tidal.engine.consistent_batch import ConsistentDecodeBatch
from tidal.engine.fast_batch import FastDecodeBatch
from tidal.engine.fused import fast_decoder
from tidal.engine.fused import refresh as refresh_fused
from tidal.engine.model import load_policy_model
from tidal.engine.prefix import PrefixCache, PrefixStats
from tidal.engine.tiny import resolve_model

if TYPE_CHECKING:
    import torch

_SEED_MASK = (1 << 63) - 1
NUMERICS = ("standard", "consistent")
DTYPES = ("float32", "bfloat16")  # kv_dtype's; matmul_dtype's also "auto"


def _plain_kv(model: Any) -> bool:
    """Whether every layer's KV cache is plain full attention (prefix-cacheable): a
    sliding-window layer keeps only its last window, which a later prompt cannot reuse."""
    from transformers import DynamicCache

    return all(type(layer).__name__ == "DynamicLayer"
               for layer in DynamicCache(config=model.config).layers)


@dataclass
class _Counts:
    """The worker's counters between two `metrics()` calls."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    prefills: int = 0  # forwards of their own
    prefill_s: float = 0.0
    folded: int = 0  # admissions prefilled in a decode step (their seconds are decode_s)
    decode_steps: int = 0
    decode_rows: int = 0
    decode_s: float = 0.0


@dataclass
class _Pending:
    request: SequenceRequest
    future: Future[tuple[SequenceResult, int, int]]  # result, policy version, batch size
    version: int = 0  # set at admission
    batch_size: int = 0  # rows in the batch right after admission


def batch_class(model: Any, numerics: str = "standard") -> type[DecodeBatch]:
    """The batch the engine runs `model` with: the consistent one for `numerics =
    "consistent"`, else the fast one (`fast_batch.py`) where the model has a fast step
    (`fused.unsupported`), else transformers' forward (`batch.py`)."""
    if numerics == "consistent":
        return ConsistentDecodeBatch
    return FastDecodeBatch if fast_decoder(model) is not None else DecodeBatch


def _check_settings(*, max_batch_size: int, batch_wait_s: float, numerics: str,
                    prefix_cache_mb: float, matmul_dtype: str, kv_dtype: str) -> None:
    """An `EngineError` naming the first of `EmbeddedEngine`'s settings out of range."""
    if max_batch_size < 1:
        raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if batch_wait_s < 0:
        raise EngineError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
    if numerics not in NUMERICS:
        raise EngineError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if prefix_cache_mb < 0:
        raise EngineError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
    for key, value, allowed in (("matmul_dtype", matmul_dtype, (*DTYPES, "auto")),
                                ("kv_dtype", kv_dtype, DTYPES)):
        if value not in allowed:
            raise EngineError(f"{key} must be one of {allowed}, got {value!r}")
        if value != "float32" and numerics == "consistent":
            raise EngineError(f"{key} {value!r} is for the standard numerics: the consistent "
                              "batch computes what the trainer does, in the model's dtype")


def resolve_matmul_dtype(model: Any, matmul_dtype: str) -> str:
    """`matmul_dtype` as the engine runs it: "auto" is "bfloat16" where the model has the
    fast step and oneDNN runs bf16 matmuls on this CPU (`fused.bf16_matmuls`), else
    "float32"; the others are themselves."""
    if matmul_dtype != "auto":
        return matmul_dtype
    from tidal.engine.fused import bf16_matmuls, unsupported

    return "bfloat16" if unsupported(model) is None and bf16_matmuls() else "float32"


def _make_fast_step(model: Any, matmul_dtype: str, kv_dtype: str) -> None:
    """Make `model`'s fast decode step (its fused weights) with `matmul_dtype`'s linear
    layers and a `kv_dtype` KV store; an `EngineError` where bf16 is asked and cannot be
    had."""
    import torch

    try:
        fast = fast_decoder(
            model, matmul_dtype=torch.bfloat16 if matmul_dtype == "bfloat16" else None,
            kv_dtype=torch.bfloat16 if kv_dtype == "bfloat16" else None)
    except ValueError as e:
        raise EngineError(str(e)) from e
    if fast is None and "bfloat16" in (matmul_dtype, kv_dtype):
        from tidal.engine.fused import unsupported

        raise EngineError(f"matmul_dtype {matmul_dtype!r}, kv_dtype {kv_dtype!r}: bf16 needs "
                          f"the fast decode step, which this model has not: "
                          f"{unsupported(model)}")


class EmbeddedEngine:
    """Transformers model behind the `Engine` protocol, with a batching request queue."""

    def __init__(
        self,
        model: str | Path = "tiny",
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        policy_version: int = 0,
        model_name: str | None = None,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        seed: int | None = None,
        max_context: int | None = None,
        numerics: str = "standard",
        prefix_cache_mb: float = 256.0,
        matmul_dtype: str = "float32",
        kv_dtype: str = "float32",
    ) -> None:
        import torch

        _check_settings(max_batch_size=max_batch_size, batch_wait_s=batch_wait_s,
                        numerics=numerics, prefix_cache_mb=prefix_cache_mb,
                        matmul_dtype=matmul_dtype, kv_dtype=kv_dtype)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"device {device!r} requested but CUDA is not available")
        self._dir = resolve_model(model)
        self._device = torch.device(device)
        self._model = load_policy_model(self._dir, device=self._device, dtype=dtype)
        self._numerics = numerics
        if numerics == "consistent":
            from tidal.engine.consistent import ConsistencyError, ConsistentModel

            try:
                ConsistentModel(self._model)
            except ConsistencyError as e:
                raise EngineError(str(e)) from e
        else:
            matmul_dtype = resolve_matmul_dtype(self._model, matmul_dtype)
            _make_fast_step(self._model, matmul_dtype, kv_dtype)  # now, not on the first step
        self._dtypes = {"matmul_dtype": matmul_dtype, "kv_dtype": kv_dtype}
        config = self._model.config
        self._vocab_size = int(config.vocab_size)
        self._max_context = int(config.max_position_embeddings)
        if max_context is not None:
            if not 1 < max_context <= self._max_context:
                raise EngineError(
                    f"max_context must be in (1, {self._max_context}] for this model, "
                    f"got {max_context}"
                )
            self._max_context = max_context
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else 0
        self._prefix = (
            PrefixCache(int(prefix_cache_mb * 2**20))
            if prefix_cache_mb > 0 and (numerics == "consistent" or _plain_kv(self._model))
            else None
        )
        self._model_name = model_name or (model if model == "tiny" else self._dir.name)
        self._version = int(policy_version)
        self._max_batch = max_batch_size
        self._wait_s = batch_wait_s
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._model_lock = threading.Lock()  # held while sequences run or weights change
        self._update_lock = threading.Lock()  # one weight update at a time
        self._update_waiting = threading.Event()
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self._submit_lock = threading.Lock()
        self._counts = _Counts()
        self._evicted_seen = 0
        self._counts_lock = threading.Lock()
        self._worker = threading.Thread(target=self._serve, name="tidal-engine", daemon=True)
        self._worker.start()

    # -- protocol ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def max_batch_size(self) -> int:
        """The most sequences one decode step runs (more wait in the queue)."""
        return self._max_batch

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model_dir(self) -> Path:
        return self._dir

    @property
    def model(self) -> Any:
        """The underlying transformers model (read it under no concurrent update)."""
        return self._model

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (lookups, hits, tokens reused, entries, bytes);
        None when it is off (`prefix_cache_mb=0`, or a model with sliding-window layers)."""
        return self._prefix.stats if self._prefix is not None else None

    def metrics(self) -> dict[str, Any]:
        """What the engine did since the last call (the run logs it per step and per
        evaluation): requests, prompt tokens and how many of them the prefix cache served
        (`prefix_cache_hit_rate`), generated tokens, the worker's busy seconds split into
        prefills (admitting calls in forwards of their own) and decode steps (the fast
        batch's also prefill the calls admitted while rows run: `folded_prefills`), the
        mean live batch of a decode step, `tokens_per_s` of busy time, prefix-cache
        evictions, and the dtypes the decode step runs in (`matmul_dtype` as resolved:
        "auto" is never reported)."""
        with self._counts_lock:
            c, self._counts = self._counts, _Counts()
        evicted = self._prefix.stats.evicted if self._prefix is not None else 0
        c_evicted, self._evicted_seen = evicted - self._evicted_seen, evicted
        busy = c.prefill_s + c.decode_s
        return {
            "requests": c.requests,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "prefix_cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "generated_tokens": c.generated,
            "busy_s": busy,
            "prefill_s": c.prefill_s,
            "prefills": c.prefills,
            "folded_prefills": c.folded,
            "decode_s": c.decode_s,
            "decode_steps": c.decode_steps,
            "mean_batch": c.decode_rows / c.decode_steps if c.decode_steps else 0.0,
            "tokens_per_s": c.generated / busy if busy else 0.0,
            "prefix_cache_evicted": c_evicted,
            **self._dtypes,
        }

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt (`Engine.generate`). `session` is accepted and
        ignored: one engine in process has one prefix cache, which finds a session's
        history by its tokens whichever session sends them."""
        if self._closed:
            raise EngineError("engine is closed")
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params must be SamplingParams, got {type(params).__name__}")
        checked = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        if not checked:
            return []
        pending = []
        for i, prompt in enumerate(checked):
            if params.seed is not None:
                seed = mix_seed(params.seed, i)
            else:
                with self._rng_lock:
                    seed = int(self._rng.integers(0, _SEED_MASK))
            fut: Future[tuple[SequenceResult, int, int]] = Future()
            pending.append(_Pending(SequenceRequest(prompt, params, seed), fut))
        with self._submit_lock:
            if self._closed:
                raise EngineError("engine is closed")
            for item in pending:
                self._queue.put(item)
        results = []
        for item in pending:
            res, version, batch = item.future.result()
            results.append(
                Generation(
                    output_ids=np.asarray(res.output_ids, dtype=np.int32),
                    logprobs=np.asarray(res.logprobs, dtype=np.float32),
                    finish_reason=res.finish_reason,
                    policy_version=version,
                    extra={"batch_size": float(batch), "cached_tokens": float(res.cached_tokens)},
                    top_logprobs=res.top_logprobs,
                )
            )
        return results

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        """Copy new weights into the model in place and set the policy version.

        `source` is `Weights` from the trainer (its tensors are copied; tensors in process
        never go through a file) or a checkpoint directory (safetensors; its config.json,
        if any, must describe the served architecture). Keys must match the model's; a
        tied lm_head.weight may be given (as in `model.state_dict()`) or omitted. Waits
        for running sequences to finish; empties the prefix cache.
        """
        import json

        import torch

        if version < 0:
            raise EngineError(f"policy version must be >= 0, got {version}")
        weights = as_weights(source)
        if weights.written:
            path = weights.directory()
            if not path.is_dir():
                raise EngineError(f"update_weights: no checkpoint directory at {path}")
            cfg_path = path / "config.json"
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text())
                ours = self._model.config
                for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
                    if key in cfg and cfg[key] != getattr(ours, key, None):
                        raise EngineError(
                            f"update_weights: {path} has {key}={cfg[key]!r}, the served model "
                            f"has {getattr(ours, key, None)!r}; weights cannot change the "
                            "architecture"
                        )
            if not any(path.glob("*.safetensors")):
                raise EngineError(f"update_weights: no *.safetensors files in {path}")
        state_dict = dict(weights.tensors())
        params = dict(self._model.named_parameters(remove_duplicate=False))  # tied keys too
        params.update(dict(self._model.named_buffers(remove_duplicate=False)))
        unexpected = sorted(set(state_dict) - set(params))
        if unexpected:
            raise EngineError(f"update_weights: unexpected keys {unexpected[:5]}")
        tied = {"lm_head.weight"} if self._model.config.tie_word_embeddings else set()
        named_params = dict(self._model.named_parameters(remove_duplicate=False))
        missing = sorted(k for k in named_params if k not in state_dict and k not in tied)
        if missing:
            raise EngineError(f"update_weights: missing keys {missing[:5]}")
        for key, value in state_dict.items():
            if tuple(value.shape) != tuple(params[key].shape):
                raise EngineError(
                    f"update_weights: {key} has shape {tuple(value.shape)}, "
                    f"expected {tuple(params[key].shape)}"
                )
        with self._update_lock:
            self._update_waiting.set()  # the worker stops admitting and drains
            try:
                with self._model_lock, torch.no_grad():
                    for key, value in state_dict.items():
                        params[key].copy_(value.to(device=self._device, dtype=params[key].dtype))
                    refresh_fused(self._model)  # the fast decode step's copies of them
                    self._version = int(version)
                    if self._prefix is not None:
                        self._prefix.clear()  # its KV was computed with the old weights
            finally:
                self._update_waiting.clear()

    def forget(self, session: str) -> None:
        """Sessions share one prefix cache, which evicts by recency: nothing to drop."""

    def close(self) -> None:
        """Stop the worker thread once queued requests are served."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._worker.join()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _check_prompt(
        self, index: int, prompt: Sequence[int] | npt.NDArray[Any]
    ) -> tuple[int, ...]:
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise EngineError(f"prompt {index} must be a flat sequence of token ids")
        if arr.size == 0:
            raise EngineError(f"prompt {index} is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise EngineError(f"prompt {index} must hold integer token ids, got {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self._vocab_size:
            bad = lo if lo < 0 else hi
            raise EngineError(
                f"prompt {index} has token id {bad} outside the vocabulary [0, {self._vocab_size})"
            )
        if arr.size >= self._max_context:
            raise EngineError(
                f"prompt {index} is {arr.size} tokens; the context is {self._max_context} "
                "(the prompt must leave room for at least one generated token)"
            )
        return tuple(int(x) for x in arr.tolist())

    def _serve(self) -> None:
        """Worker loop: continuous batching, one model lock per busy period.

        While sequences are live the worker holds the model lock and, between decode steps,
        admits queued sequences (up to `max_batch_size`). A weight update raises
        `_update_waiting`: admission stops, the live sequences finish, the lock is released
        and the update applies, so no sequence ever mixes two weight versions.
        """
        kind = batch_class(self._model, self._numerics)
        batch = kind(self._model, max_context=self._max_context, pad_id=self._pad_id,
                     prefix=self._prefix)
        closing = False
        while True:
            if not len(batch):
                if closing:
                    return
                first = self._queue.get()
                if first is None:
                    return
                items, closing = self._collect(self._max_batch - 1, self._wait_s)
                items.insert(0, first)
                with self._model_lock:
                    self._busy_period(batch, items)
            # _busy_period returns only once the batch is empty again.
            if closing and not len(batch):
                return

    def _collect(self, n: int, wait_s: float) -> tuple[list[_Pending], bool]:
        """Up to `n` queued items, waiting at most `wait_s`; True if close() was seen."""
        items: list[_Pending] = []
        deadline = time.monotonic() + wait_s
        while len(items) < n:
            remaining = deadline - time.monotonic()
            try:
                if remaining > 0:
                    item = self._queue.get(timeout=remaining)
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        return items, False

    def _busy_period(self, batch: DecodeBatch, items: list[_Pending]) -> None:
        closing = False
        try:
            while True:
                if items and len(batch) and batch.folds:
                    self._step(batch, items)  # their prompts prefilled in the decode step
                else:
                    self._admit(batch, items)
                    self._finish(batch.pop_finished())
                    if not len(batch):
                        break
                    self._step(batch, [])
                items = []
                if not closing and not self._update_waiting.is_set() and batch.can_merge:
                    items, closing = self._collect(self._max_batch - len(batch), 0.0)
                self._finish(batch.pop_finished())
        except Exception as e:  # surface model errors to every caller in the batch
            err = EngineError(f"generation failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            for pending in [*batch.live_tags(), *items]:
                if not pending.future.done():
                    pending.future.set_exception(err)
            batch.clear()
        if closing:
            self._queue.put(None)  # seen while busy: let _serve see it again

    def _running(self, items: list[_Pending]) -> list[_Pending]:
        """The items not cancelled meanwhile, marked running, with the policy version they
        are sampled with."""
        live = [p for p in items if p.future.set_running_or_notify_cancel()]
        for p in live:
            p.version = self._version
        return live

    def _admit(self, batch: DecodeBatch, items: list[_Pending]) -> None:
        live = self._running(items)
        if not live:
            return
        size = len(batch) + len(live)
        t0 = time.perf_counter()
        batch.admit([p.request for p in live], live)
        with self._counts_lock:
            self._counts.prefill_s += time.perf_counter() - t0
            self._counts.prefills += 1
            self._counts.requests += len(live)
            self._counts.prompt_tokens += sum(len(p.request.prompt) for p in live)
        for p in live:
            p.batch_size = size

    def _step(self, batch: DecodeBatch, items: list[_Pending]) -> None:
        """One decode step of the batch; `items` join in it (`DecodeBatch.step`)."""
        live = self._running(items)
        t0, rows = time.perf_counter(), len(batch)
        batch.step([p.request for p in live], live)
        with self._counts_lock:
            self._counts.decode_s += time.perf_counter() - t0
            self._counts.decode_steps += 1
            self._counts.decode_rows += rows
            if live:
                self._counts.folded += 1
                self._counts.requests += len(live)
                self._counts.prompt_tokens += sum(len(p.request.prompt) for p in live)
        for p in live:
            p.batch_size = rows + len(live)

    def _finish(self, done: list[tuple[_Pending, SequenceResult]]) -> None:
        """Hand finished sequences back to their callers."""
        if done:
            with self._counts_lock:
                self._counts.generated += sum(len(res.output_ids) for _, res in done)
                self._counts.cached_tokens += sum(res.cached_tokens for _, res in done)
        for pending, res in done:
            pending.future.set_result((res, pending.version, pending.batch_size))
