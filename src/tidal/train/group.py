"""The trainer as N ranks: built the same way on each, commanded and watched from rank 0.

`tidal run` holds a `TrainerGroup`, whatever the world size. Rank 0 is the run's own
process (it also holds the gateway, the engine and the loop); the other ranks are
started by the group and do nothing but train:

    processes   on this machine (`train.nodes = 1`): `python -m tidal.train.group`
    ray         Ray actors, one per rank, in a placement group (`train.nodes > 1`)
    attached    started by someone else: `tidal run` under torchrun (env://)

Every rank builds a `RankTrainer` from one `TrainerSpec` (plain data). An operation on
the group (`step`, `warm_start`, `state_dict`, `save`) is announced under a numbered key
in the process group's store, its arguments broadcast from rank 0, and then run on
every rank at once (FSDP's collectives inside). A rank that dies (SIGKILL included)
makes the operation fail with `TrainerRankError` naming it: the run stops before its
checkpoint, so the last checkpoint holds nothing half-trained and `--resume` continues
from it. Ranks whose rank 0 is gone exit on their own.

With one rank there is no process group: the same `RankTrainer`, called directly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from tidal.engine.base import Adapter, Weights
from tidal.train.distributed import (
    Ranks,
    checkpoint_activations,
    full_state_dict,
    load_state,
    materialize,
    peak_memory_mb,
    save_state,
    shard_policy,
)
from tidal.train.heap import release_free_heap
from tidal.train.lora import LoraSpec, apply_lora, merged_state_dict
from tidal.train.loss import LossConfig
from tidal.train.precision import MatmulDtype, matmuls, resolve_matmul_dtype
from tidal.train.trainer import StepMetrics, TargetLM, TreeTrainer
from tidal.train.warmstart import Example, warm_start
from tidal.tree.types import TrainTree

TRAIN_STATE = "train_state"  # the DCP directory inside a run checkpoint
_CMD = "tidal/cmd/"


class TrainerRankError(RuntimeError):
    """A trainer rank died or failed; the message names it and the operation."""


@dataclass(frozen=True)
class TrainerSpec:
    """What every rank needs to build its trainer (the same on each)."""

    weights_dir: str  # the transformers checkpoint the policy starts from
    device: str  # "cpu" | "cuda" (rank r uses cuda:r of its node)
    lr: float
    loss: LossConfig
    max_tokens: int
    attention: str = "auto"
    world_size: int = 1
    nodes: int = 1
    lora: LoraSpec | None = None
    activation_checkpointing: bool = False
    state_dir: str | None = None  # a DCP training state to continue from
    threads: int = 0  # torch threads of ranks 1..N-1 (0: torch's default)
    matmul_dtype: MatmulDtype = "float32"  # the linear layers' (tidal.train.precision)
    timeout_s: float = 1800.0  # a collective that waits longer fails

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainerSpec:
        d = json.loads(text)
        d["loss"] = LossConfig(**d["loss"])
        if d["lora"] is not None:
            d["lora"] = LoraSpec(**{**d["lora"], "targets": tuple(d["lora"]["targets"])})
        return cls(**d)


@dataclass(frozen=True)
class WarmStartPlan:
    """The supervised warm start's settings (`tidal.train.warmstart.warm_start`): one
    step per batch of demonstration indices."""

    batches: tuple[tuple[int, ...], ...]
    lr: float
    pad_id: int


def _rank_device(spec: TrainerSpec, ranks: Ranks) -> torch.device:
    if spec.device != "cuda":
        return torch.device(spec.device)
    local = int(os.environ.get("LOCAL_RANK", ranks.rank % max(torch.cuda.device_count(), 1)))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class RankTrainer:
    """One rank's trainer: the policy (LoRA, activation checkpointing, FSDP2 as the spec
    says) inside a `TargetLM`, its AdamW, and a `TreeTrainer`. Every method is called on
    every rank with the same arguments."""

    def __init__(self, spec: TrainerSpec, ranks: Ranks) -> None:
        from tidal.engine.model import load_policy_model

        if spec.threads and ranks.rank > 0:  # rank 0 shares its process with the engine
            torch.set_num_threads(spec.threads)
        self.spec, self.ranks = spec, ranks
        self.device = _rank_device(spec, ranks)
        self.matmul_dtype = resolve_matmul_dtype(spec.matmul_dtype, self.device)
        if ranks.distributed:
            model = self._sharded(spec, ranks)
        else:
            lm = load_policy_model(Path(spec.weights_dir), device=str(self.device),
                                   dtype=torch.float32)
            model = TargetLM(apply_lora(lm, spec.lora) if spec.lora is not None else lm)
            if spec.activation_checkpointing:
                checkpoint_activations(model)
        self.config = model.lm.config
        self.model = model
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=spec.lr, weight_decay=0.0)
        if spec.state_dir is not None and Path(spec.state_dir).exists():
            load_state(Path(spec.state_dir), model, self.optimizer)
        self.trainer = TreeTrainer(model, self.optimizer, spec.loss, max_tokens=spec.max_tokens,
                                   attention=spec.attention, ranks=ranks)
        self.updates = 0
        self._full: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self.peak_memory_mb: list[float] = []

    def _sharded(self, spec: TrainerSpec, ranks: Ranks) -> TargetLM:
        """The policy as FSDP2 shards: every rank builds it on the meta device and
        allocates its own shards; rank 0 reads the checkpoint (on CPU) and broadcasts it
        (`materialize`), so no rank needs memory for the whole model on its device."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from tidal.engine.model import load_policy_model

        def wrapped(lm: Any) -> TargetLM:
            return TargetLM(apply_lora(lm, spec.lora) if spec.lora is not None else lm)

        source = wrapped(load_policy_model(Path(spec.weights_dir), device="cpu",
                                           dtype=torch.float32)) if ranks.rank == 0 else None
        config = AutoConfig.from_pretrained(spec.weights_dir, local_files_only=True)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, attn_implementation="sdpa", dtype=torch.float32)
        model = wrapped(lm.eval())
        if spec.activation_checkpointing:
            checkpoint_activations(model)
        shard_policy(model, ranks, self.device)
        materialize(model, source, ranks, self.device)
        return model

    def step(self, trees: Sequence[TrainTree]) -> StepMetrics:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with matmuls(self.matmul_dtype):
            m = self.trainer.step(trees)
        self.updates += 1
        release_free_heap()  # the step's freed activations: back to the system
        self.peak_memory_mb = self.ranks.gather_floats(peak_memory_mb(self.device))
        return m

    def set_reference(self, weights_dir: str) -> None:
        """Load the transformers checkpoint `weights_dir`, frozen, as the KL term's
        reference policy (`LossConfig.kl_coef`)."""
        from tidal.engine.model import load_policy_model

        lm = load_policy_model(Path(weights_dir), device=str(self.device), dtype=torch.float32)
        lm.requires_grad_(False)
        self.trainer.set_reference(TargetLM(lm))

    def warm_start(self, examples: Sequence[Example], plan: WarmStartPlan,
                   on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
        with matmuls(self.matmul_dtype):
            losses = warm_start(self.model, examples, batches=plan.batches, lr=plan.lr,
                                pad_id=plan.pad_id, on_step=on_step, ranks=self.ranks)
        self.updates += 1
        release_free_heap()
        return losses

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights on rank 0 (LoRA merged in: what an engine serves),
        gathered once per update."""
        return self.gathered()[0]

    def gathered(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """On rank 0, once per update: the full weights (LoRA merged in) and, with LoRA,
        the adapters in peft's saved-adapter names (for engines that load adapters)."""
        if self._full is None or self._full[0] != self.updates:
            sd = full_state_dict(self.model, self.ranks)
            adapters: dict[str, torch.Tensor] = {}
            if self.spec.lora is not None and sd:
                adapters = {k.replace(".default.", "."): v.detach().clone()
                            for k, v in sd.items() if ".lora_A." in k or ".lora_B." in k}
                sd = merged_state_dict(sd, self.spec.lora)
            self._full = (self.updates, sd, adapters)
        return self._full[1], self._full[2]

    def save(self, out: str) -> None:
        """The training state (model and optimizer, sharded) under `out/train_state`;
        rank 0 also writes the merged weights as a transformers checkpoint in `out`."""
        save_state(Path(out) / TRAIN_STATE, self.model, self.optimizer)
        sd = self.state_dict()
        if self.ranks.rank == 0:
            write_checkpoint(Path(out), sd, self.config)


def write_checkpoint(out: Path, state_dict: dict[str, torch.Tensor], config: Any) -> None:
    """A transformers checkpoint (safetensors + config) of `state_dict`, through a model
    skeleton on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    # a tied parameter (lm_head.weight = embed_tokens.weight) is stored once, as
    # transformers stores it: gathered from shards, its two names hold two copies
    first: dict[int, str] = {}
    tied = {name for name, p in skeleton.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}
    out.mkdir(parents=True, exist_ok=True)
    skeleton.save_pretrained(out, state_dict={k: v for k, v in state_dict.items()
                                              if k not in tied}, safe_serialization=True)


# --------------------------------------------------------------------------- the group


@dataclass
class _Worker:
    rank: int
    handle: Any  # the process (subprocess.Popen) or the Ray actor
    alive: Callable[[], bool]
    describe: Callable[[], str]
    stop: Callable[[], None]


@dataclass
class TrainerGroup:
    """Rank 0's handle on every rank. `launch`: "processes", "ray" or "attached"."""

    spec: TrainerSpec
    launch: str = "processes"
    log_dir: Path | None = None
    local: RankTrainer | None = None
    workers: list[_Worker] = field(default_factory=list)
    _store: Any = None
    _n: int = 0
    _broken: str | None = None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def config(self) -> Any:
        """The policy's transformers config (what a checkpoint of it is written with)."""
        return self._one().config

    def start(self) -> TrainerGroup:
        spec = self.spec
        if spec.world_size == 1:
            self.local = RankTrainer(spec, Ranks())
            return self
        import torch.distributed as dist

        backend = "nccl" if spec.device == "cuda" else "gloo"
        _rank_device(spec, Ranks(0, spec.world_size))  # NCCL: this rank's GPU, set before
        timeout = timedelta(seconds=spec.timeout_s)  # the first collective (the spec's)
        if self.launch == "attached":  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
            dist.init_process_group(backend, timeout=timeout)
            self._store = dist.distributed_c10d._get_default_store()
        else:
            host = _node_address() if self.launch == "ray" else "127.0.0.1"
            self._store = TCPStore(host, 0, spec.world_size, is_master=True,
                                        timeout=timeout, wait_for_workers=False)
            start = _start_ray if self.launch == "ray" else _start_processes
            self.workers = start(spec, host, int(self._store.port), self.log_dir)
            dist.init_process_group(backend, store=self._store, rank=0,
                                    world_size=spec.world_size, timeout=timeout)
        try:
            self.local = self._call("__init__")
        except BaseException:
            self.close()
            raise
        return self

    def shrunk(self, checkpoint: Path | None) -> TrainerGroup:
        """After ranks were lost (their node died): this group closed, and a group of the
        ranks left started from `checkpoint` (a run checkpoint: its weights and its
        sharded training state, which load at any world size), or from where this group
        started when there is none yet. Ray ranks only: a lost rank's bundle is placed
        again only when the cluster has room, so the group goes on without it."""
        if self.launch != "ray":
            raise ValueError("only Ray trainer ranks (train.nodes > 1) shrink")
        left = self.world_size - max(len(self._dead()), 1)
        spec = self.spec
        if checkpoint is not None:
            state = checkpoint / TRAIN_STATE
            spec = replace(spec, weights_dir=str(checkpoint.resolve()),
                           state_dir=str(state.resolve()) if state.exists() else None)
        spec = replace(spec, world_size=left, nodes=min(spec.nodes, left))
        self.close()
        return TrainerGroup(spec, launch="ray" if left > 1 else "processes",
                            log_dir=self.log_dir).start()

    def _dead(self) -> list[_Worker]:
        return [w for w in self.workers if not w.alive()]

    def _check(self, op: str) -> None:
        if self._broken:
            raise TrainerRankError(self._broken)
        dead = self._dead()
        if dead:
            self._fail("; ".join(f"trainer rank {w.rank} {w.describe()}" for w in dead),
                       f"before {op}")

    def _fail(self, why: str, when: str) -> None:
        self._broken = (f"{why} {when}: that step did not finish and nothing of it was "
                        "checkpointed (`tidal run --resume` continues from the last "
                        "checkpoint)")
        raise TrainerRankError(self._broken)

    def _call(self, op: str, *args: Any, **here: Any) -> Any:
        """`op` on every rank: announced, its arguments broadcast, run here too (with the
        keyword arguments `here` that only rank 0 has, such as a progress callback). Any
        failure leaves the process group unusable: the group is then broken."""
        self._check(op)
        ranks = Ranks(0, self.spec.world_size)
        self._store.set(f"{_CMD}{self._n}", op)
        self._n += 1
        try:
            ranks.broadcast(args)
            if op == "__init__":
                return RankTrainer(self.spec, ranks)
            return getattr(self.local, op)(*args, **here)
        except Exception as e:
            time.sleep(0.5)  # a dead rank's exit status settles
            dead = self._dead()
            why = "; ".join(f"trainer rank {w.rank} {w.describe()}" for w in dead) or \
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            try:
                self._fail(why, f"during {op}")
            except TrainerRankError as err:
                raise err from e

    def _one(self) -> RankTrainer:
        assert self.local is not None, "TrainerGroup.start() first"
        return self.local

    def step(self, trees: Sequence[TrainTree]) -> StepMetrics:
        if self.world_size == 1:
            return self._one().step(trees)
        m: StepMetrics = self._call("step", list(trees))
        return m

    def warm_start(self, examples: Sequence[Example], plan: WarmStartPlan,
                   on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
        if self.world_size == 1:
            return self._one().warm_start(examples, plan, on_step)
        losses: list[float] = self._call("warm_start", list(examples), plan, on_step=on_step)
        return losses

    def set_reference(self, weights_dir: Path) -> None:
        """The KL term's reference policy: the transformers checkpoint `weights_dir`."""
        if self.world_size > 1:
            raise ValueError("a KL reference (rl.kl_coef > 0) trains in one process: set "
                             "train.world_size = 1")
        self._one().set_reference(str(weights_dir))

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.world_size == 1:
            return self._one().state_dict()
        sd: dict[str, torch.Tensor] = self._call("state_dict")
        return sd

    def weights(self, out: Path) -> Weights:
        """The newest update's weights for `Engine.update_weights` (gathered from the
        ranks once): the merged tensors in process, a transformers checkpoint written to
        `out` when an engine asks for one, and with LoRA the adapters themselves."""
        if self.world_size == 1:
            sd, adapters = self._one().gathered()
        else:
            sd, adapters = self._call("gathered")
        lora, config = self.spec.lora, self.config
        adapter = Adapter(adapters, r=lora.r, alpha=lora.alpha,
                          targets=lora.targets) if lora is not None else None
        return Weights(lambda: iter(sd.items()), target=out, adapter=adapter,
                       write=lambda d: write_checkpoint(d, sd, config))

    def save(self, out: Path) -> None:
        if self.world_size == 1:
            self._one().save(str(out))
        else:
            self._call("save", str(out))

    def metrics(self) -> dict[str, Any]:
        """What a step row carries about the trainer: world size, each rank's peak MB,
        the dtype its linear layers multiply in."""
        one = self._one()
        return {"world_size": self.world_size,
                "peak_memory_mb_per_rank": [round(x, 1) for x in one.peak_memory_mb],
                "train_matmul_dtype": str(one.matmul_dtype).removeprefix("torch.")}

    def close(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        if self._store is not None and not self._broken and not self._dead():
            with contextlib.suppress(Exception):
                self._store.set(f"{_CMD}{self._n}", "close")
        deadline = time.monotonic() + 10
        while self.workers and time.monotonic() < deadline and any(w.alive() for w in self.workers):
            time.sleep(0.1)
        for w in self.workers:
            w.stop()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# --------------------------------------------------------------------------- launchers


def _node_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child before exec
    """The child gets SIGTERM when its parent (rank 0) dies, SIGKILL included."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_processes(spec: TrainerSpec, host: str, port: int,
                     log_dir: Path | None) -> list[_Worker]:
    workers = []
    for rank in range(1, spec.world_size):
        env = {**os.environ, "TIDAL_TRAINER_SPEC": spec.to_json(), "LOCAL_RANK": str(rank)}
        if spec.threads:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        log = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            log = (log_dir / f"rank-{rank}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.train.group", "--rank", str(rank), "--world",
             str(spec.world_size), "--addr", host, "--port", str(port)],
            env=env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=_set_pdeathsig)  # noqa: PLW1509 - only prctl, async-signal-safe
        if log is not None:
            log.close()
        workers.append(_Worker(rank, proc, functools.partial(_running, proc),
                               functools.partial(_exit_text, proc),
                               functools.partial(_stop_process, proc)))
    return workers


def _running(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _exit_text(proc: subprocess.Popen[bytes]) -> str:
    code = proc.poll()
    if code is None:
        return "is not answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _RankActor:
    """Body of a Ray actor that is one trainer rank (wrapped with `ray.remote`)."""

    def serve(self, spec_json: str, rank: int, world: int, host: str, port: int) -> None:
        serve(TrainerSpec.from_json(spec_json), rank, world, host, port)


def _start_ray(spec: TrainerSpec, host: str, port: int,
               log_dir: Path | None) -> list[_Worker]:
    """Ranks 1..N-1 as Ray actors, one bundle each ({"GPU": 1} on CUDA, else {"CPU": 1}),
    spread over `spec.nodes` nodes as the placement group packs them."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()
    resource = "GPU" if spec.device == "cuda" else "CPU"
    pg = placement_group([{resource: 1}] * (spec.world_size - 1),
                         strategy="SPREAD" if spec.nodes > 1 else "PACK")
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        raise TrainerRankError(f"Ray could not place {spec.world_size - 1} trainer ranks "
                               f"({resource}: 1 each): does the cluster have them?")
    cls: Any = ray.remote(_RankActor)
    workers = []
    for rank in range(1, spec.world_size):
        actor: Any = cls.options(
            num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank - 1)).remote()
        ref = actor.serve.remote(spec.to_json(), rank, spec.world_size, host, port)

        def alive(r: Any = ref) -> bool:
            done, _ = ray.wait([r], timeout=0)
            return not done

        def describe(r: Any = ref) -> str:
            try:
                ray.get(r, timeout=0)
            except Exception as e:
                return f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            return "ended"

        workers.append(_Worker(rank, actor, alive, describe, functools.partial(ray.kill, actor)))
    return workers


# --------------------------------------------------------------------------- a rank's loop


def serve(spec: TrainerSpec, rank: int, world: int, host: str | None = None,
          port: int | None = None) -> None:
    """Ranks 1..N-1: join the group, then run each announced operation until "close".
    Without host/port, join through env:// (torchrun)."""
    import torch.distributed as dist

    backend = "nccl" if spec.device == "cuda" else "gloo"
    # NCCL: the rank's own GPU before its first collective (the broadcast of each
    # operation's arguments), else every rank would use cuda:0
    _rank_device(spec, Ranks(rank, world))
    timeout = timedelta(seconds=spec.timeout_s)
    if host is None or port is None:
        dist.init_process_group(backend, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    else:
        store = TCPStore(host, port, world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    ranks = Ranks(rank, world)
    trainer: RankTrainer | None = None
    n = 0
    try:
        while True:
            key = f"{_CMD}{n}"
            while True:
                try:
                    store.wait([key], timedelta(seconds=5))
                    break
                except dist.DistNetworkError:  # the store is gone: so is rank 0
                    return
                except dist.DistStoreError:  # a timeout: rank 0 is rolling out; wait on
                    continue
            op = store.get(key).decode()
            n += 1
            if op == "close":
                return
            args = ranks.broadcast(None)
            if op == "__init__":
                trainer = RankTrainer(spec, ranks)
            else:
                getattr(trainer, op)(*args)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one trainer rank (started by tidal run)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    serve(TrainerSpec.from_json(os.environ["TIDAL_TRAINER_SPEC"]), a.rank, a.world, a.addr,
          a.port)


if __name__ == "__main__":
    main()


__all__ = ["TrainerGroup", "TrainerRankError", "TrainerSpec", "serve", "write_checkpoint"]
