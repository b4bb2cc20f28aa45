"""One rank's part in a training step across ranks: collectives, FSDP2, trees per rank.

The tree trainer (`tidal.train.trainer`) runs unchanged on every rank; what differs
between one process and N is held here, so that with `Ranks()` (one rank) every helper
is the identity and the trainer has one code path:

- `Ranks`: this rank and the world, and the few collectives the trainer needs (a sum, a
  max, an object from rank 0). One rank: no process group, nothing sent.
- `assign_trees`: trees to ranks by token count (longest first to the least loaded
  rank), trees that start alike kept together so that merging still shares their
  prefix. Every rank computes the same assignment from the same list.
- `shard_policy`: FSDP2 (`fully_shard`) per decoder layer and at the root, gradients
  summed across ranks (divide factor 1: the loss is already normalised over the whole
  batch, so the sum of the ranks' gradients is the one-rank gradient), optional
  activation checkpointing per layer.
- `full_state_dict`: the whole model gathered on rank 0 (CPU), for the engine and for
  the transformers checkpoint; `save_state` / `load_state`: model and optimizer through
  torch.distributed.checkpoint, sharded, readable at any world size (one rank included).

Deliberately simplified: one mesh dimension (pure FSDP, no tensor or pipeline
parallelism); the gather is a full state dict at once rather than tensor by tensor.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import resource
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tidal.tree.types import TrainTree


@dataclass(frozen=True)
class Ranks:
    """This process's rank among `world` trainer ranks (the default: one, no group)."""

    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over ranks, in place (the identity on one rank)."""
        if self.distributed:
            _all_reduce(t, dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            _all_reduce(t, dist.ReduceOp.MAX)
        return t

    def max_int(self, n: int) -> int:
        return int(self.max_(torch.tensor([n], dtype=torch.int64))[0])

    def gather_floats(self, x: float) -> list[float]:
        """Every rank's value, in rank order (on every rank)."""
        if not self.distributed:
            return [x]
        dev = _collective_device(torch.device("cpu"))
        out = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([x], dtype=torch.float64, device=dev))
        return [float(t[0]) for t in out]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _collective_device(device: torch.device) -> torch.device:
    """Where a tensor on `device` must be for the default group's collectives: NCCL
    (`train.world_size > 1` on CUDA) moves only CUDA tensors, so a CPU tensor goes
    through this rank's GPU; gloo, or a group with a CPU backend, takes it as it is."""
    if device.type == "cpu" and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _all_reduce(t: torch.Tensor, op: Any) -> None:
    """`dist.all_reduce(t, op)` in place, for a CPU tensor on NCCL too (the trainer's
    metric sums and counts are CPU tensors)."""
    dev = _collective_device(t.device)
    if dev == t.device:
        dist.all_reduce(t, op=op)
        return
    u = t.to(dev)
    dist.all_reduce(u, op=op)
    t.copy_(u)


def _start_key(tree: TrainTree) -> bytes:
    return hashlib.blake2b(tree.segments[0].token_ids.tobytes(), digest_size=8).digest()


def assign_trees(trees: Sequence[TrainTree], world: int) -> list[list[TrainTree]]:
    """Trees per rank, balanced by unique tokens. Trees with one root segment (a GRPO
    group's sessions of one task) form one unit, so a rank can merge their shared
    prefix; while there are fewer units than ranks, the largest unit is split. Units go
    longest first to the least loaded rank (ties: the lowest rank). Deterministic."""
    if world == 1:
        return [list(trees)]
    units: dict[bytes, list[TrainTree]] = {}
    for t in trees:
        units.setdefault(_start_key(t), []).append(t)
    groups = list(units.values())
    while len(groups) < world and any(len(g) > 1 for g in groups):
        big = max((g for g in groups if len(g) > 1), key=lambda g: sum(t.unique_tokens for t in g))
        groups.remove(big)
        half = len(big) // 2
        groups += [big[:half], big[half:]]
    groups.sort(key=lambda g: -sum(t.unique_tokens for t in g))
    out: list[list[TrainTree]] = [[] for _ in range(world)]
    load = [0] * world
    for g in groups:
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].extend(g)
        load[r] += sum(t.unique_tokens for t in g)
    return out


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layers of a transformers causal LM (a peft-wrapped one included)."""
    lm: Any = getattr(model, "lm", model)
    layers = getattr(lm.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(lm).__name__}: no decoder layers to shard")
    return layers


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them
    (torch.utils.checkpoint, non-reentrant): peak memory falls from one set of
    activations per layer to one layer's, for about one more forward. Parameter names
    are unchanged. Gradients are the same (tested)."""
    from torch.utils.checkpoint import checkpoint

    from tidal.train.precision import matmul_dtype, matmuls

    for layer in decoder_layers(model):
        if getattr(layer, "_tidal_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            dtype = matmul_dtype()  # the recomputation multiplies as the forward did

            def contexts() -> tuple[contextlib.AbstractContextManager[None],
                                    contextlib.AbstractContextManager[None]]:
                return contextlib.nullcontext(), matmuls(dtype)

            return checkpoint(_inner, *args, use_reentrant=False, context_fn=contexts,
                              **kwargs)

        layer.forward = functools.wraps(inner)(forward)
        layer._tidal_checkpointed = True  # type: ignore[assignment]


def shard_policy(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """FSDP2 over `ranks`: each decoder layer one unit, the rest (embeddings, final norm,
    output head, tied or not) the root's. Gradients are summed, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (ranks.world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def materialize(model: torch.nn.Module, source: torch.nn.Module | None, ranks: Ranks,
                device: torch.device) -> None:
    """Give a sharded `model` built on the meta device its weights from rank 0's
    `source` (the same module tree, on CPU; None on the other ranks): each rank
    allocates only its shards, then rank 0 broadcasts the full tensors shard by shard
    (no rank but 0 ever holds the whole model, and none on its accelerator). Buffers that
    no state dict holds (the rotary embedding's inverse frequencies) are copied from
    `source` and broadcast too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    src = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if source is not None:
                buf.copy_(src[name])
            dist.broadcast(buf, src=0)


def full_state_dict(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """The whole model's tensors: gathered to rank 0's CPU (empty elsewhere) when
    sharded; on one rank, the model's own (detached, not copied: read them before the
    model trains again). Keys are the model's own (a `TargetLM`'s `lm.` removed)."""
    if ranks.distributed:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        sd = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = {k: v.detach() for k, v in model.state_dict().items()}  # read before it trains
    return {k.removeprefix("lm."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """torch.distributed.checkpoint warns that it runs without a process group on one
    rank: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state, sharded (each rank writes its shards; on one rank the
    whole), with torch.distributed.checkpoint: `load_state` reads it at any world size."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    # gradients left over (a warm start's) would keep an optimizer that has not stepped
    # from getting the state it gets on load: the two would not match
    optimizer.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, optimizer)
    with _one_process_quiet():
        save({"model": msd, "optimizer": osd}, checkpoint_id=str(path),
             no_dist=not dist.is_initialized())


def load_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What `save_state` wrote, resharded to this model's layout (any world size)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    msd, osd = get_state_dict(model, optimizer)
    with _one_process_quiet():
        load({"model": msd, "optimizer": osd}, checkpoint_id=str(path),  # in place
             no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak memory: CUDA's peak allocation since the last reset, else the
    process's peak resident set (CPU: it only grows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
