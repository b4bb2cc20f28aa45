"""LoRA for the tree trainer: low-rank adapters through peft, merged weights for the engine.

Full fine-tuning keeps gradients and optimizer state for every weight of the policy.
`apply_lora` wraps a transformers causal LM with peft's LoRA instead: each target
Linear computes W x + s B A x (s = alpha / r, A of shape [r, in], B of shape [out, r],
B zero at the start), its base weight W frozen, so only A and B train. Nothing in the
tree trainer changes: peft delegates `get_decoder()`, `get_output_embeddings()` and
`config` to the wrapped model, whose decoder layers now hold the adapted Linears, so
tree attention, the K/V cache of partitioned trees and the loss run as before and
their gradients reach A and B (`tests/train/test_lora.py` checks tree-vs-path gradient
equality on the adapters).

The engine never sees an adapter: after each step it receives `merged_state_dict`, the
plain model's state dict with W + s B A in every target (computed in float32 from the
gathered state dict, a pure function), which is what `merge_and_unload` would give
without merging the training model in place (merge then unmerge would round W twice
per step in bfloat16). The engine's weight update path is the same as for full
fine-tuning.

The trainer runs the model in eval mode, so the recompute pass (the pre-update
log-probabilities) has no dropout; `lora_dropout` switches only the adapters' dropout
on, for the gradient pass when `LoraSpec.dropout > 0`.

Deliberately simplified: one adapter, Linear targets only (matched by module-name
suffix, as peft does), one rank and alpha for all targets, no DoRA, rsLoRA, LoRA bias
or modules_to_save; a target whose weight is tied to another module (an `lm_head` tied
to the input embeddings) is refused, because merging it would change the embeddings
too and the merged model would not be the trained one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

PEFT_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


class LoraError(ValueError):
    """A LoRA setting or state dict that cannot work; the message names the config key."""


@dataclass(frozen=True)
class LoraSpec:
    """The `[train] lora = {r, alpha, dropout, targets}` table; validated on creation.

    `targets` are module-name suffixes of Linear layers (`q_proj` matches every
    `...self_attn.q_proj`); a list is stored as a tuple.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        targets: object = self.targets
        if isinstance(targets, list):  # a TOML array
            object.__setattr__(self, "targets", tuple(targets))
        _validate(self)

    @property
    def scaling(self) -> float:
        """s in W + s B A."""
        return self.alpha / self.r

    def peft_config(self) -> Any:
        """The peft `LoraConfig` of this spec."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # annotated int, used as a number
            lora_dropout=self.dropout,
            target_modules=list(self.targets),
            bias="none",
        )


def _validate(spec: LoraSpec) -> None:
    r: object = spec.r
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"train.lora.r must be an integer >= 1, got {r!r}")
    alpha: object = spec.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise LoraError(f"train.lora.alpha must be a finite number > 0, got {alpha!r}")
    dropout: object = spec.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise LoraError(f"train.lora.dropout must be in [0, 1), got {dropout!r}")
    targets: object = spec.targets
    if (
        not isinstance(targets, tuple)
        or not targets
        or not all(isinstance(t, str) and t and not t.startswith(".") for t in targets)
    ):
        raise LoraError(
            "train.lora.targets must be a non-empty list of module-name suffixes such as "
            f'["q_proj", "v_proj"], got {targets!r}'
        )


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target modules: the whole name or a dotted suffix."""
    return name == target or name.endswith("." + target)


def check_targets(model: nn.Module, spec: LoraSpec) -> None:
    modules = [(n, m) for n, m in model.named_modules() if n]
    linear = [n for n, m in modules if isinstance(m, nn.Linear)]
    suffixes = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))

    missing = [t for t in spec.targets if not any(_matches(n, t) for n in linear)]
    if missing:
        raise LoraError(
            f"train.lora.targets: no Linear module of the model matches {', '.join(missing)}; "
            f"its Linear modules are {', '.join(suffixes) or '(none)'}"
        )
    other = sorted(
        {
            f"{n} ({type(m).__name__})"
            for n, m in modules
            for t in spec.targets
            if _matches(n, t) and not isinstance(m, nn.Linear)
        }
    )
    if other:
        raise LoraError(
            f"train.lora.targets also name modules that are not Linear: {', '.join(other)}; "
            f"LoRA here adapts Linear modules only ({', '.join(suffixes)})"
        )
    owners: dict[int, list[str]] = {}
    for n, m in modules:
        for pn, p in m.named_parameters(prefix=n, recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append(pn)
    tied = sorted(
        {
            f"{n} (tied to {', '.join(o for o in owners[id(m.weight)] if o != n + '.weight')})"
            for n, m in modules
            if isinstance(m, nn.Linear)
            and any(_matches(n, t) for t in spec.targets)
            and len(owners[id(m.weight)]) > 1
        }
    )
    if tied:
        raise LoraError(
            f"train.lora.targets: {', '.join(tied)} share their weight with another module; "
            "a merged adapter would change both, so the merged model would not be the "
            "trained one. Leave them out of the targets"
        )


def has_lora(model: nn.Module) -> bool:
    """Whether `model` holds LoRA adapter modules."""
    return any(hasattr(m, "lora_A") for m in model.modules())


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """`model` (a transformers causal LM) wrapped with peft LoRA adapters per `spec`.

    The model is modified in place (its target Linears become peft LoRA layers); only
    adapter parameters keep `requires_grad`. Every module keeps its train/eval mode and
    the new adapter modules take the model's (peft creates them in train mode, which
    would make a model in eval mode drop out in its LoRA branch).
    """
    from peft import get_peft_model

    _validate(spec)
    if has_lora(model):
        raise LoraError("train.lora: the model already has LoRA adapters")
    check_targets(model, spec)
    modes = {id(m): m.training for m in model.modules()}
    top = model.training
    wrapped: nn.Module = get_peft_model(model, spec.peft_config())
    for m in wrapped.modules():
        m.training = modes.get(id(m), top)
    return wrapped


def merged_state_dict(state_dict: Mapping[str, Tensor], spec: LoraSpec) -> dict[str, Tensor]:
    """The plain model's state dict, with every adapter merged: W + s B A.

    `state_dict` is the full (gathered) state dict of a peft-wrapped model, keys with or
    without peft's `base_model.model.` prefix (`...q_proj.base_layer.weight`,
    `...q_proj.lora_A.default.weight`, `...q_proj.lora_B.default.weight`). The result
    has the plain model's keys in the same order (`...q_proj.weight`); the merge is
    computed in float32 and cast to W's dtype; every other tensor is passed through
    as it is. Pure: the input is not modified.
    """
    _validate(spec)
    out: dict[str, Tensor] = {}
    adapters: dict[str, dict[str, Tensor]] = {}
    adapter_name: dict[str, str] = {}
    for key, tensor in state_dict.items():
        k = key.removeprefix(PEFT_PREFIX)
        m = _ADAPTER_KEY.match(k)
        if m is not None:
            module, ab, name = m["module"], m["ab"], m["adapter"]
            if adapter_name.setdefault(module, name) != name:
                raise LoraError(
                    f"train.lora: {module} has two adapters ({adapter_name[module]}, {name}); "
                    "only one can be merged"
                )
            if ab in adapters.setdefault(module, {}):
                raise LoraError(f"train.lora: {module}.lora_{ab} appears twice ({key})")
            adapters[module][ab] = tensor
            continue
        parts = k.split(".")
        if any(p.startswith("lora_") for p in parts):
            raise LoraError(f"train.lora: unsupported adapter tensor {key} (Linear LoRA only)")
        plain = ".".join(p for p in parts if p != "base_layer")
        if plain in out:
            raise LoraError(f"train.lora: the state dict holds {plain} twice ({key})")
        out[plain] = tensor
    with torch.no_grad():
        for module, ab in adapters.items():
            if set(ab) != {"A", "B"}:
                have, lack = ("A", "B") if "A" in ab else ("B", "A")
                raise LoraError(f"train.lora: {module} has lora_{have} without lora_{lack}")
            A, B = ab["A"], ab["B"]
            wkey = module + ".weight"
            W = out.get(wkey)
            if W is None:
                raise LoraError(
                    f"train.lora: no base weight for the adapter of {module}; "
                    "merged_state_dict needs the model's full state dict, not the adapters only"
                )
            if A.shape[0] != spec.r:
                raise LoraError(
                    f"train.lora.r is {spec.r} but the adapter of {module} has rank {A.shape[0]}"
                )
            if A.dim() != 2 or B.shape != (W.shape[0], A.shape[0]) or A.shape[1] != W.shape[1]:
                raise LoraError(
                    f"train.lora: adapter shapes of {module} (A {tuple(A.shape)}, "
                    f"B {tuple(B.shape)}) do not fit its weight {tuple(W.shape)}"
                )
            delta = B.to(torch.float32) @ A.to(device=B.device, dtype=torch.float32)
            merged = W.to(torch.float32) + spec.scaling * delta.to(W.device)
            out[wkey] = merged.to(W.dtype)
        _refuse_tied(state_dict, out, adapters)
    return out


def _storage(t: Tensor) -> int:
    if t.device.type == "meta":
        return 0
    return int(t.untyped_storage().data_ptr())


def _refuse_tied(
    state_dict: Mapping[str, Tensor], out: Mapping[str, Tensor], adapters: Mapping[str, object]
) -> None:
    """A merged weight whose tensor the input shares with another key (tied weights)
    would leave that key unmerged: a model unlike the trained one."""
    merged_ptrs: dict[int, str] = {}
    for key, t in state_dict.items():
        k = key.removeprefix(PEFT_PREFIX)
        if k.endswith(".base_layer.weight") and k.removesuffix(".base_layer.weight") in adapters:
            ptr = _storage(t)
            if ptr:
                merged_ptrs[ptr] = k.removesuffix(".base_layer.weight")
    if not merged_ptrs:
        return
    merged_keys = {m + ".weight" for m in adapters}
    for key, t in out.items():
        if key not in merged_keys and _storage(t) in merged_ptrs:
            raise LoraError(
                f"train.lora.targets: {merged_ptrs[_storage(t)]} shares its weight with {key} "
                "(tied weights); merging would change both. Leave it out of the targets"
            )


def _dropouts(model: nn.Module) -> list[nn.Dropout]:
    """The LoRA adapters' dropout modules (none with `dropout = 0`: peft's Identity)."""
    return [
        d
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleDict) and name.rsplit(".", 1)[-1] == "lora_dropout"
        for d in m.values()
        if isinstance(d, nn.Dropout)
    ]


def has_lora_dropout(model: nn.Module) -> bool:
    """Whether the gradient pass runs dropout (`lora_dropout`), so that its log-probabilities
    differ from the no-grad pass's."""
    return any(d.p > 0 for d in _dropouts(model))


@contextmanager
def lora_dropout(model: nn.Module, active: bool) -> Iterator[None]:
    """Inside, every LoRA dropout module is in train mode if `active`, else in eval mode
    (whatever the rest of the model's mode); their modes are restored after. A no-op
    for models without LoRA or with `dropout = 0` (peft then uses an Identity)."""
    drops = _dropouts(model)
    before = [d.training for d in drops]
    for d in drops:
        d.training = active
    try:
        yield
    finally:
        for d, was in zip(drops, before, strict=True):
            d.training = was


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that train (with LoRA: the adapters'), for the optimizer."""
    return [p for p in model.parameters() if p.requires_grad]
