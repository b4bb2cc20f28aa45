"""Tree trainer: recompute old log-probabilities, correct, PPO/GRPO loss, backward, step.

`TreeTrainer.step(trees)`:
1. `merge_trees` (trees that start alike share their common prefix; `merge=False` turns
   it off), then `pack_trees` (DFS streams, several trees per stream, big trees
   partitioned);
2. `recompute_logprobs` without gradient (the trainer's pre-update log-probabilities),
   capturing per-layer keys/values of partitioned trees. With a correction that masks
   nothing ("none", "tis": `one_pass`) and no LoRA dropout, only partitioned trees take
   this pass; the others' old log-probabilities are step 4's own, detached (one optimizer
   step per batch makes them the same numbers, bit for bit), which saves a forward of
   every such stream;
3. importance correction against the engine's rollout log-probabilities, the loss
   denominators D_g over the whole batch, mismatch metrics;
4. one forward + backward per stream, in reverse stream order. A partition's ancestor
   context is the keys/values cached in step 2 (leaf tensors); after its backward their
   gradients are added into a per-token K/V gradient buffer, which the earlier partition
   that produced those keys injects into its own backward. The sum over partitions is
   then exactly the gradient of the unpartitioned tree, with no context token
   recomputed; the cost is 2 x layers x tokens x kv_dim cached values (and as many
   gradients) for partitioned trees only;
5. optional gradient-norm clip, optimizer step.

Across ranks (`ranks`, `tidal.train.distributed`; the model sharded with FSDP2), every
rank gets the whole list of trees and trains its share (`assign_trees`): the loss
denominators D_g are summed over ranks before any loss is formed and G counts every
group of the batch, so each rank's loss is its share of the one-rank loss and the ranks'
summed gradients are the one-rank gradient. A rank with fewer streams than another runs
idle passes (a two-token stream of weight 0), so that every rank makes as many forwards
and backwards as FSDP's collectives expect.

`attention="consistent"` runs steps 2 and 4 on `tidal.engine.consistent`'s batch-invariant
forward: with an engine sampling from the same forward (`numerics="consistent"`), the
recomputed log-probabilities equal the rollout ones bit for bit, and the mismatch
metrics read 0 (trees must then fit one stream).

Trees whose norm groups hold only branches of advantage 0 carry no policy-gradient
signal (typically a GRPO group whose sessions all earned the same reward: about half of
them in `tidal run`). Without a KL term they are not packed, recomputed or
backpropagated, while the loss keeps counting their norm groups in G, so the gradient is
exactly that of the whole batch. A batch with no signal at all takes no optimizer step
(its metrics are zeros, with `trees_skipped`). The mismatch metrics are measured over
the trained trees.

Shape letters: N targets, P pairs, B branches, V vocabulary, G key/value heads, U tokens
of a tree, D head dim.

Deliberately simplified: one optimizer step per batch (no PPO mini-batches or epochs),
so the PPO ratio r is 1 at the step and the clip only acts through its gradient; the
loss assumes logits = lm_head(hidden) (Qwen2/Qwen3/Llama; no final logit soft-capping).
"""

# ruff: noqa: N815 - shape-suffix field names (old_N) are the project convention
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tidal.engine.consistent import ConsistentModel, stream_key_lists
from tidal.train.attention import StreamPlan, enable_tree_attention
from tidal.train.distributed import Ranks, assign_trees
from tidal.train.lora import has_lora_dropout, lora_dropout
from tidal.train.loss import LossConfig, pair_correction, pair_loss, token_correction
from tidal.train.merge import merge_trees
from tidal.train.packing import PackedBatch, PackedStream, pack_trees
from tidal.tree.types import Branch, Segment, TrainTree

DEFAULT_MAX_MASK_BYTES = 2 << 30


class KVCache:
    """Per-layer keys/values (and their gradients) of partitioned trees, by DFS index."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grad: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def store(self, tree: int, start: int, n_tree_tokens: int, plan: StreamPlan) -> None:
        for layer, (k, v) in plan.captured.items():
            key = (tree, layer)
            if key not in self.kv:
                shape = (*k.shape[:2], n_tree_tokens, k.shape[3])
                self.kv[key] = (k.new_zeros(shape), v.new_zeros(shape))
            K, V = self.kv[key]
            K[:, :, start : start + k.shape[2]] = k.detach()
            V[:, :, start : start + v.shape[2]] = v.detach()

    def context(
        self, stream: PackedStream, n_layers: int, requires_grad: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for layer in range(n_layers):
            K, V = self.kv[(stream.ctx_tree, layer)]
            idx = torch.as_tensor(stream.ctx_pre_C, device=K.device)
            k, v = K.index_select(2, idx), V.index_select(2, idx)
            out.append((k.requires_grad_(requires_grad), v.requires_grad_(requires_grad)))
        return out

    def add_grad(self, stream: PackedStream, ctx: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        idx = None
        for layer, (k, v) in enumerate(ctx):
            key = (stream.ctx_tree, layer)
            if key not in self.grad:
                K, _ = self.kv[key]
                self.grad[key] = (torch.zeros_like(K), torch.zeros_like(K))
            gK, gV = self.grad[key]
            idx = torch.as_tensor(stream.ctx_pre_C, device=gK.device) if idx is None else idx
            if k.grad is not None:
                gK.index_add_(2, idx, k.grad)
            if v.grad is not None:
                gV.index_add_(2, idx, v.grad)

    def own_grads(
        self, tree: int, start: int, plan: StreamPlan
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(k, v, dk, dv) for this stream's captured keys/values that later streams used."""
        out = []
        for layer, (k, v) in plan.captured.items():
            g = self.grad.get((tree, layer))
            if g is None:
                continue
            n = k.shape[2]
            out.append((k, v, g[0][:, :, start : start + n], g[1][:, :, start : start + n]))
        return out


def _lm(model: torch.nn.Module) -> Any:
    """The causal LM inside a `TargetLM` (or the model itself)."""
    return model.lm if isinstance(model, TargetLM) else model


def _n_layers(model: torch.nn.Module) -> int:
    return int(getattr(_lm(model).config, "num_hidden_layers"))  # noqa: B009


def target_logits(
    lm: Any, input_ids_B_T: torch.Tensor, pred_N: torch.Tensor, *,
    position_ids_B_T: torch.Tensor | None = None, attention_mask: Any = None,
) -> torch.Tensor:
    """float32 logits [N, V] read at the flat positions `pred_N` of [B, T]: the decoder
    runs on every token, the vocabulary projection on the N read positions only (full
    logits would dwarf the model with a 151k vocabulary)."""
    out = lm.get_decoder()(input_ids=input_ids_B_T, position_ids=position_ids_B_T,
                           attention_mask=attention_mask, use_cache=False)
    h_N = out.last_hidden_state.flatten(0, 1).index_select(0, pred_N)
    logits: torch.Tensor = lm.get_output_embeddings()(h_N).float()
    return logits


class TargetLM(torch.nn.Module):
    """A causal LM whose forward is `target_logits`: the one module the trainer calls,
    so FSDP2 can be its root (the embeddings, final norm and output head, tied or not,
    are gathered by the root's hooks; each decoder layer is its own unit)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self) -> Any:
        return self.lm.config

    def forward(self, input_ids_B_T: torch.Tensor, pred_N: torch.Tensor, *,
                position_ids_B_T: torch.Tensor | None = None,
                attention_mask: Any = None) -> torch.Tensor:
        return target_logits(self.lm, input_ids_B_T, pred_N, position_ids_B_T=position_ids_B_T,
                             attention_mask=attention_mask)


def logits_at(model: torch.nn.Module, input_ids_B_T: torch.Tensor, pred_N: torch.Tensor, *,
              position_ids_B_T: torch.Tensor | None = None,
              attention_mask: Any = None) -> torch.Tensor:
    """`target_logits` through the model's own call when it is a `TargetLM` (FSDP's
    hooks run), directly on a plain causal LM."""
    if isinstance(model, TargetLM):
        out: torch.Tensor = model(input_ids_B_T, pred_N, position_ids_B_T=position_ids_B_T,
                                  attention_mask=attention_mask)
        return out
    return target_logits(model, input_ids_B_T, pred_N, position_ids_B_T=position_ids_B_T,
                         attention_mask=attention_mask)


def stream_logprobs(model: torch.nn.Module, plan: StreamPlan) -> torch.Tensor:
    """Log-probabilities [N] of the stream's targets, each read at its predecessor."""
    st = plan.stream
    dev = plan.device
    if plan.backend == "consistent":
        return consistent_logprobs(_lm(model), st, dev)
    logits_N_V = logits_at(
        model, torch.as_tensor(st.input_ids_T, device=dev)[None],
        torch.as_tensor(st.target_pred_N, device=dev),
        position_ids_B_T=torch.as_tensor(st.position_ids_T, device=dev)[None],
        attention_mask=plan)
    tgt = torch.as_tensor(st.target_ids_N, device=dev)
    return logits_N_V.gather(1, tgt[:, None])[:, 0] - logits_N_V.logsumexp(-1)


def consistent_logprobs(
    model: torch.nn.Module, st: PackedStream, dev: torch.device
) -> torch.Tensor:
    """`stream_logprobs` on the batch-invariant forward (`tidal.engine.consistent`): the
    same log-softmax of the same float32 logits the consistent engine samples from."""
    cm = ConsistentModel(model)
    ids = torch.as_tensor(st.input_ids_T, device=dev)
    pos = torch.as_tensor(st.position_ids_T, device=dev)
    grad = None
    if torch.is_grad_enabled():  # attention's gradients from the tree attention's kernels
        plan = StreamPlan(st, dev, backend="blocks", max_mask_bytes=DEFAULT_MAX_MASK_BYTES)

        def grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = plan.attend(0, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                              v.transpose(0, 1)[None], cm.scale)
            return out[0].transpose(0, 1)

    h_T = cm.hidden(ids, pos, stream_key_lists(st.blocks, st.n_tokens, dev),
                    attention_grad=grad)
    h_N = h_T.index_select(0, torch.as_tensor(st.target_pred_N, device=dev))
    return cm.logprobs(h_N, torch.as_tensor(st.target_ids_N, device=dev, dtype=torch.long))


def _plan(
    st: PackedStream, dev: torch.device, attention: str, max_mask_bytes: int,
    ctx: list[tuple[torch.Tensor, torch.Tensor]] | None,
) -> StreamPlan:
    """The attention plan of one stream; partitioned trees capture their keys/values."""
    return StreamPlan(st, dev, backend=attention, max_mask_bytes=max_mask_bytes, ctx_kv=ctx,
                      capture=st.partition is not None)


def recompute_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    attention: str = "auto",
    max_mask_bytes: int = DEFAULT_MAX_MASK_BYTES,
    kv_cache: KVCache | None = None,
    streams: Sequence[PackedStream] | None = None,
) -> torch.Tensor:
    """Trainer log-probabilities [N] of every target, without gradient (global order).

    Partitioned trees always go through a K/V cache (a fresh one when none is given);
    pass `kv_cache` to keep it for a backward pass. `streams` (default: all of the
    batch's) are the ones computed; the others' targets read 0.
    """
    enable_tree_attention(_lm(model))
    dev = next(model.parameters()).device
    cache = kv_cache if kv_cache is not None else KVCache()
    n_layers = _n_layers(model)
    out = torch.zeros(batch.n_targets, device=dev)
    with torch.no_grad():
        for st in batch.streams if streams is None else streams:
            ctx = cache.context(st, n_layers, False) if st.n_context else None
            plan = _plan(st, dev, attention, max_mask_bytes, ctx)
            lp = stream_logprobs(model, plan)
            out[st.target_offset : st.target_offset + st.n_targets] = lp
            if st.partition is not None:
                tree, start = st.partition
                cache.store(tree, start, batch.layouts[tree].n_tokens, plan)
    return out


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    token_kl: float  # mean over trained tokens of (rollout - trainer) log-probability
    seq_kl: float  # mean over branches of the summed token KL
    k3_kl: float
    chi2: float
    ess: float  # effective sample size of rho, normalised to (0, 1]
    masked_fraction: float  # pairs masked by the correction
    is_clipped_fraction: float  # pairs whose importance weight was truncated or masked
    ppo_clip_fraction: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    tree_token_ratio: float  # path tokens / unique tokens
    tokens: int
    path_tokens: int
    streams: int
    grad_norm: float
    seconds: float
    trees_skipped: int = 0  # trees without signal (all advantages 0), not trained
    ref_kl: float = 0.0  # with a KL reference: mean over target tokens of (trainer - reference)

    @classmethod
    def empty(cls, skipped: int, seconds: float) -> StepMetrics:
        """A batch without signal: nothing trained, no optimizer step."""
        zero = {f: 0.0 for f in cls.__dataclass_fields__ if f not in ("seconds", "trees_skipped")}
        return cls(**zero, seconds=seconds, trees_skipped=skipped)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PairTerms:
    """Batch-level pair arrays after correction, shared by all streams' losses."""

    old_N: torch.Tensor
    ref_N: torch.Tensor | None
    adv_P: torch.Tensor
    w_P: torch.Tensor
    scale_P: torch.Tensor  # coef_b * m / (D_g * G): the pair's weight in the batch loss
    m_P: torch.Tensor
    delta_N: torch.Tensor
    pair_target_P: torch.Tensor  # global target index
    pair_branch_P: torch.Tensor
    rollout_N: torch.Tensor

    def set_old(self, st: PackedStream, pair_offset: int, old_N: torch.Tensor,
                cfg: LossConfig) -> None:
        """One stream's old log-probabilities given after the terms were built (the grad
        pass's own, detached: `one_pass`), with its pairs' token-level weights. The
        correction must be mask-free (`one_pass`), so that no D_g depends on them."""
        if not one_pass(cfg):  # checked before anything is written
            raise ValueError(f"correction {cfg.correction!r} masks pairs or acts per sequence: "
                             "the old log-probabilities must come before the terms")
        tgt = slice(st.target_offset, st.target_offset + st.n_targets)
        self.old_N[tgt] = old_N
        self.delta_N[tgt] = old_N - self.rollout_N[tgt]
        tok = token_correction(self.delta_N[tgt], cfg)
        assert tok is not None  # one_pass: a token-level correction
        sl = slice(pair_offset, pair_offset + st.pair_target_P.shape[0])
        self.w_P[sl] = tok[0][self.pair_target_P[sl] - st.target_offset]


def one_pass(cfg: LossConfig) -> bool:
    """Whether a step can skip the no-grad pass and read the old log-probabilities off the
    grad pass (detached). With one optimizer step per batch they are the same numbers,
    and a correction that masks nothing ("none", "tis") leaves every D_g independent of
    them, so the batch-wide terms are known before any stream's forward. Partitioned
    trees still take the no-grad pass, which caches the keys/values their later
    partitions attend to."""
    return cfg.correction in ("none", "tis")


def build_pair_terms(
    batch: PackedBatch,
    old_N: torch.Tensor,
    cfg: LossConfig,
    ref_N: torch.Tensor | None = None,
    *,
    groups: Sequence[str] | None = None,
    ranks: Ranks | None = None,
) -> PairTerms:
    """`groups`: every norm group of the loss, in one order on every rank, when they
    differ from the batch's own (the trainer leaves out trees with no signal but keeps
    counting their groups; a rank holds a share of the batch). D_g is summed over
    `ranks`, so G and D_g are those of the whole batch on every rank."""
    dev = old_N.device
    tgt = torch.as_tensor(
        np.concatenate([s.pair_target_P + s.target_offset for s in batch.streams]), device=dev
    )
    br = torch.as_tensor(np.concatenate([s.pair_branch_P for s in batch.streams]), device=dev)
    roll = torch.as_tensor(batch.rollout_logprobs_N, device=dev)
    delta = old_N - roll
    n_b = int(batch.branch_advantage_B.shape[0])
    w, m = pair_correction(delta, tgt, br, n_b, cfg)
    coef = torch.as_tensor(batch.branch_coef_B, device=dev)[br]
    names = list(groups) if groups is not None else list(batch.group_names)
    index = {name: i for i, name in enumerate(names)}
    to_global = torch.as_tensor([index[g] for g in batch.group_names], dtype=torch.long,
                                device=dev)
    grp = to_global[torch.as_tensor(batch.branch_group_B, device=dev)[br]]
    G = len(names)
    D = torch.zeros(G, device=dev).index_add_(0, grp, coef * m)
    if ranks is not None:
        ranks.sum_(D)
    inv = torch.where(D > 0, 1.0 / (D * G), torch.zeros_like(D))
    return PairTerms(
        old_N=old_N,
        ref_N=ref_N,
        adv_P=torch.as_tensor(batch.branch_advantage_B, device=dev)[br],
        w_P=w,
        scale_P=coef * m * inv[grp],
        m_P=m,
        delta_N=delta,
        pair_target_P=tgt,
        pair_branch_P=br,
        rollout_N=roll,
    )


def stream_loss(
    new_N: torch.Tensor, st: PackedStream, terms: PairTerms, pair_offset: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """This stream's share of the batch loss, and its PPO clip indicator per pair."""
    sl = slice(pair_offset, pair_offset + st.pair_target_P.shape[0])
    tg_local = terms.pair_target_P[sl] - st.target_offset
    tg = terms.pair_target_P[sl]
    ref = terms.ref_N[tg] if terms.ref_N is not None else None
    loss_P, clip_P = pair_loss(
        new_N[tg_local], terms.old_N[tg], terms.adv_P[sl], terms.w_P[sl], cfg=cfg, ref=ref
    )
    return (terms.scale_P[sl] * loss_P).sum(), clip_P


def tree_loss_backward(
    model: torch.nn.Module,
    batch: PackedBatch,
    terms: PairTerms,
    cfg: LossConfig,
    kv_cache: KVCache,
    *,
    attention: str = "auto",
    max_mask_bytes: int = DEFAULT_MAX_MASK_BYTES,
    set_old: bool = False,
) -> tuple[float, float]:
    """Accumulate the batch loss gradient into the model; returns (loss, ppo clip frac).

    `set_old` (`one_pass`): the old log-probabilities of the streams of unpartitioned
    trees are this pass's own, detached, written into `terms` before each stream's loss.
    """
    dev = next(model.parameters()).device
    n_layers = _n_layers(model)
    offsets = np.concatenate([[0], np.cumsum([s.pair_target_P.shape[0] for s in batch.streams])])
    total = 0.0
    clipped = 0.0
    for si in range(len(batch.streams) - 1, -1, -1):
        st = batch.streams[si]
        ctx = kv_cache.context(st, n_layers, True) if st.n_context else None
        plan = _plan(st, dev, attention, max_mask_bytes, ctx)
        new_N = stream_logprobs(model, plan)
        if set_old and st.partition is None:
            terms.set_old(st, int(offsets[si]), new_N.detach(), cfg)
        loss, clip_P = stream_loss(new_N, st, terms, int(offsets[si]), cfg)
        tensors: list[torch.Tensor] = [loss]
        grads: list[torch.Tensor] = [torch.ones_like(loss)]
        if st.partition is not None:
            for k, v, dk, dv in kv_cache.own_grads(*st.partition, plan):
                tensors += [k, v]
                grads += [dk, dv]
        if any(t.requires_grad for t in tensors):
            torch.autograd.backward(tensors, grads)
        if ctx is not None:
            kv_cache.add_grad(st, ctx)
        total += float(loss.detach())
        clipped += float(clip_P.sum())
    n_pairs = int(offsets[-1])
    return total, clipped / max(n_pairs, 1)


MISMATCH_SUMS = ("n", "neg_delta", "k3", "rho2", "rho", "abs_delta", "branches", "seq",
                 "pairs", "masked", "truncated")


def mismatch_sums(batch: PackedBatch, terms: PairTerms, cfg: LossConfig) -> torch.Tensor:
    """The sums `mismatch_metrics` is made of (float64, in `MISMATCH_SUMS` order), so
    that ranks can add theirs before the ratios are taken."""
    d = terms.delta_N.double()
    rho = d.exp()
    n_b = int(batch.branch_advantage_B.shape[0])
    seq = torch.zeros(n_b, dtype=d.dtype, device=d.device)
    seq.index_add_(0, terms.pair_branch_P, -d[terms.pair_target_P])
    if cfg.correction == "tis":
        truncated = rho[terms.pair_target_P] > cfg.C
    elif cfg.correction == "seq_tis":
        truncated = (-seq)[terms.pair_branch_P] > math.log(cfg.C)
    else:
        truncated = torch.zeros_like(terms.m_P, dtype=torch.bool)
    return torch.stack([
        torch.tensor(float(d.numel()), dtype=d.dtype, device=d.device), (-d).sum(),
        (rho - d - 1).sum(), (rho**2).sum(), rho.sum(), d.abs().sum(),
        torch.tensor(float(n_b), dtype=d.dtype, device=d.device), seq.sum(),
        torch.tensor(float(terms.m_P.numel()), dtype=d.dtype, device=d.device),
        (terms.m_P == 0).double().sum(), truncated.double().sum(),
    ]).cpu()


def finish_mismatch(sums: torch.Tensor, max_abs: float) -> dict[str, float]:
    v = dict(zip(MISMATCH_SUMS, (float(x) for x in sums), strict=True))
    n, pairs = max(v["n"], 1.0), max(v["pairs"], 1.0)
    return {
        "token_kl": v["neg_delta"] / n,
        "seq_kl": v["seq"] / max(v["branches"], 1.0),
        "k3_kl": v["k3"] / n,
        "chi2": v["rho2"] / n - 1,
        "ess": v["rho"] ** 2 / (n * v["rho2"]) if v["rho2"] else 0.0,
        "masked_fraction": v["masked"] / pairs,
        "is_clipped_fraction": v["truncated"] / pairs,
        "mean_abs_logprob_diff": v["abs_delta"] / n,
        "max_abs_logprob_diff": max_abs,
    }


def mismatch_metrics(batch: PackedBatch, terms: PairTerms, cfg: LossConfig) -> dict[str, float]:
    """Rollout vs trainer mismatch over unique trained tokens (and branches for seq_kl).

    delta = trainer - rollout log-probability, rho = exp(delta):
    token_kl = mean(-delta), k3 = mean(rho - delta - 1) (both estimate
    KL(rollout || trainer) from the rollout's samples), chi2 = mean(rho^2) - 1,
    ess = (sum rho)^2 / (n sum rho^2), seq_kl = mean over branches of sum(-delta).
    is_clipped_fraction: pairs whose weight was truncated at C (tis, seq_tis).
    """
    return finish_mismatch(mismatch_sums(batch, terms, cfg),
                           float(terms.delta_N.double().abs().max()))


def _trees_with_signal(trees: Sequence[TrainTree]) -> list[TrainTree]:
    """The trees that share a norm group with some branch of non-zero advantage. The
    others contribute nothing to any group's numerator N_g, and their groups' D_g divide
    nothing else, so leaving them out changes no gradient (with G kept). A tree without
    branches is kept, for packing to reject."""
    signal = {b.norm_group for t in trees for b in t.branches if b.advantage != 0.0}
    return [t for t in trees
            if not t.branches or any(b.norm_group in signal for b in t.branches)]


def idle_tree(norm_group: str) -> TrainTree:
    """Two tokens of weight 0 (coef 0: no share of any D_g, a loss of exactly 0): what a
    rank trains when the others still have streams to run."""
    seg = Segment(parent=-1, token_ids=np.zeros(2, np.int32),
                  model_mask=np.array([False, True]), logprobs=np.zeros(2, np.float32),
                  policy_versions=np.zeros(2, np.int32))
    return TrainTree("idle", (seg,), (Branch(leaf=0, advantage=0.0, coef=0.0,
                                             norm_group=norm_group),))


class TreeTrainer:
    """Owns one policy update per call of `step`: pack, recompute, correct, loss, step.

    With `ranks` of more than one rank, `model` is this rank's FSDP2 shard of a
    `TargetLM` (`tidal.train.distributed.shard_policy`) and every rank calls `step` with
    the same trees; the metrics are the whole batch's on every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_config: LossConfig,
        *,
        max_tokens: int = 8192,
        ref_model: torch.nn.Module | None = None,
        attention: str = "auto",
        max_grad_norm: float | None = 1.0,
        max_mask_bytes: int = DEFAULT_MAX_MASK_BYTES,
        merge: bool = True,
        ranks: Ranks | None = None,
    ) -> None:
        self.ranks = ranks or Ranks()
        if self.ranks.distributed and (attention == "consistent" or ref_model is not None):
            raise ValueError("training across ranks supports neither consistent numerics nor "
                             "a reference model (KL) yet")
        self.model = model
        self.optimizer = optimizer
        self.cfg = loss_config
        self.max_tokens = max_tokens
        self.ref_model = ref_model
        self.attention = attention
        self.max_grad_norm = max_grad_norm
        self.max_mask_bytes = max_mask_bytes
        self.merge = merge
        enable_tree_attention(_lm(model))
        if ref_model is not None:
            enable_tree_attention(_lm(ref_model))

    def set_reference(self, ref_model: torch.nn.Module) -> None:
        """The frozen policy the KL term (`LossConfig.kl_coef`) pulls towards."""
        if self.ranks.distributed:
            raise ValueError("training across ranks does not support a reference model (KL) yet")
        enable_tree_attention(_lm(ref_model))
        self.ref_model = ref_model

    def _idle(self, batch: PackedBatch, n: int, *, grad: bool) -> None:
        """`n` passes over the batch's first stream with a loss of 0 (FSDP's collectives:
        every rank runs as many forwards and backwards)."""
        dev = next(self.model.parameters()).device
        st = next(s for s in batch.streams if not s.n_context)
        for _ in range(n):
            with torch.set_grad_enabled(grad):
                lp = stream_logprobs(self.model, _plan(st, dev, self.attention,
                                                       self.max_mask_bytes, None))
                if grad:
                    (lp.sum() * 0.0).backward()  # type: ignore[no-untyped-call]

    def step(self, trees: Sequence[TrainTree]) -> StepMetrics:
        t0 = time.perf_counter()
        if self.cfg.kl_coef and self.ref_model is None:
            raise ValueError("loss_config.kl_coef > 0 needs a ref_model (TreeTrainer(ref_model=) "
                             "or set_reference)")
        ranks = self.ranks
        groups = sorted({b.norm_group for t in trees for b in t.branches})
        skipped = 0
        if not self.cfg.kl_coef:  # without a KL term, a zero advantage is a zero gradient
            live = _trees_with_signal(trees)
            if not live:
                return StepMetrics.empty(len(trees), time.perf_counter() - t0)
            skipped, trees = len(trees) - len(live), live
        mine = assign_trees(trees, ranks.world)[ranks.rank]
        idle = not mine
        if self.merge and mine:
            mine = merge_trees(mine, self.max_tokens)
        batch = pack_trees(mine or [idle_tree(groups[0])], self.max_tokens)
        n_passes = ranks.max_int(len(batch.streams))
        fused = one_pass(self.cfg) and not has_lora_dropout(self.model)
        nograd = [s for s in batch.streams if not fused or s.partition is not None]
        n_nograd = ranks.max_int(len(nograd))  # before any forward: collectives in one order
        cache = KVCache()
        old = recompute_logprobs(
            self.model,
            batch,
            attention=self.attention,
            max_mask_bytes=self.max_mask_bytes,
            kv_cache=cache,
            streams=nograd,
        )
        self._idle(batch, n_nograd - len(nograd), grad=False)
        ref = None
        if self.cfg.kl_coef and self.ref_model is not None:
            ref = recompute_logprobs(
                self.ref_model, batch, attention=self.attention, max_mask_bytes=self.max_mask_bytes
            )
        terms = build_pair_terms(batch, old, self.cfg, ref, groups=groups, ranks=ranks)
        self.optimizer.zero_grad(set_to_none=True)
        with lora_dropout(self.model, True):  # LoRA's dropout, if any, in this pass only
            loss, clip_frac = tree_loss_backward(
                self.model,
                batch,
                terms,
                self.cfg,
                cache,
                attention=self.attention,
                max_mask_bytes=self.max_mask_bytes,
                set_old=fused,
            )
            self._idle(batch, n_passes - len(batch.streams), grad=True)
        ref_kl = float((old - ref).double().mean()) if ref is not None and old.numel() else 0.0
        grad_norm = float("nan")
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        n_pairs = float(terms.m_P.numel())
        sums = mismatch_sums(batch, terms, self.cfg)
        counts = torch.tensor([loss, clip_frac * n_pairs, batch.path_tokens,
                               batch.unique_tokens, len(batch.streams)], dtype=torch.float64)
        if idle:
            sums.zero_()
            counts.zero_()
        max_abs = 0.0 if idle else float(terms.delta_N.double().abs().max())
        sums = ranks.sum_(sums)
        counts = ranks.sum_(counts)
        max_abs = float(ranks.max_(torch.tensor([max_abs], dtype=torch.float64))[0])
        loss_sum, clipped, path_tokens, unique, streams = (float(x) for x in counts)
        return StepMetrics(
            loss=loss_sum,
            ppo_clip_fraction=clipped / max(float(sums[MISMATCH_SUMS.index("pairs")]), 1.0),
            tree_token_ratio=path_tokens / max(unique, 1.0),
            tokens=int(unique),
            path_tokens=int(path_tokens),
            streams=int(streams),
            grad_norm=grad_norm if not math.isnan(grad_norm) else 0.0,
            seconds=time.perf_counter() - t0,
            trees_skipped=skipped,
            ref_kl=ref_kl,
            **finish_mismatch(sums, max_abs),
        )
