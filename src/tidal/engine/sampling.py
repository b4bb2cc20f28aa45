"""Token sampling with the logprobs of the distribution actually sampled from.

Plain functions over a batch of next-token logits, one row per sequence, each row with its
own temperature, top-k and top-p (so concurrent requests with different parameters share
one forward pass). Order and conventions follow vLLM's sampler, so that the embedded and
the vLLM engines report the same numbers:

1. temperature: logits / T (rows with T == 0 are greedy, see below);
2. top-k: keep the k largest (0 = off); ties at the k-th value are cut by sort order;
3. top-p: of what is left, keep the smallest prefix (by descending probability) whose mass
   reaches p; a token is dropped when the mass strictly before it already reaches p;
4. the processed distribution is log_softmax of what is left (dropped tokens: -inf);
   the sampled token's logprob is read from it.

Greedy rows (T == 0) take the argmax of the raw logits. Their sampling distribution is a
point mass, so there is no useful logprob "of the distribution sampled from": like vLLM's
`processed_logprobs` mode, they report the model's plain log-softmax.

Sampling inverts each row's cumulative distribution at one uniform draw from that row's
own generator, so a seeded row's draws do not depend on which other rows share its batch.
A batch whose rows are all greedy (held-out evaluation) builds no distribution at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities [B, V] (float32) of the distribution each row samples from.

    logits: [B, V]; temperature, top_p: [B] float; top_k: [B] int (0 = off).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    if not bool((temp == 1).all()):  # x / 1 is x, bit for bit: skip a pass over [B, V]
        x = x / temp[:, None]
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & ~greedy, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    p = torch.where(greedy, torch.ones_like(top_p), top_p).float()
    if bool((k < vocab).any()) or bool((p < 1).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device)
        drop_sorted = ranks[None, :] >= k[:, None]
        sorted_x = sorted_x.masked_fill(drop_sorted, float("-inf"))
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted |= (mass_before >= p[:, None]) & (p[:, None] < 1)
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.log_softmax(dim=-1)


# Vocabulary entries per block of the two-level inverse CDF (`sample_tokens`).
CDF_BLOCK = 1024


def sample_tokens(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Sample one token per row of `logprobs` [B, V]; greedy rows take the argmax."""
    if len(generators) != logprobs.shape[0]:
        raise ValueError("one generator per row is required")
    # Inverse CDF: one uniform per row (one draw per row instead of one per vocabulary
    # entry), drawn for greedy rows too, so a generator's state does not depend on them.
    u = torch.empty(len(generators), 1, dtype=torch.float64, device=logprobs.device)
    for i, gen in enumerate(generators):
        u[i].uniform_(generator=gen)
    if bool(greedy.all()):  # nothing sampled (greedy evaluation): no CDF to build
        return logprobs.argmax(dim=-1)
    sampled = inverse_cdf(logprobs.exp(), 1.0 - u)  # 1 - u in (0, 1]
    if not bool(greedy.any()):  # the argmax would be thrown away: skip a pass over [B, V]
        return sampled
    return torch.where(greedy, logprobs.argmax(dim=-1), sampled)


def inverse_cdf(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V] (float32, unnormalised), the first token whose cumulative
    mass reaches `q` [B, 1] (float64, in (0, 1]) of the row's total: never a token of zero
    mass. The cumulative sums are float64 (the tail of a 151k vocabulary keeps its mass),
    in two levels: the mass of each block of `CDF_BLOCK` tokens, then the running sum
    within the one block the draw falls in. The full [B, V] running sum in float64 is
    never written (at a batch of 64 it was the most of a decode step's sampling), and the
    token drawn is the full sequential sum's except where the draw falls within float64
    rounding of a boundary between two tokens."""
    rows, vocab = probs.shape
    w = min(CDF_BLOCK, vocab)
    n = -(-vocab // w)
    if n * w != vocab:
        probs = torch.nn.functional.pad(probs, (0, n * w - vocab))  # zero mass
    blocks = probs.view(rows, n, w)
    mass = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, n]
    target = q * mass[:, -1:]  # in (0, total]
    # the first block whose running mass reaches the target (it has mass of its own)
    blk = torch.searchsorted(mass, target).clamp_(max=n - 1)  # [B, 1]
    before = mass.gather(-1, (blk - 1).clamp(min=0)).masked_fill_(blk == 0, 0.0)
    inner = blocks.gather(1, blk[:, :, None].expand(rows, 1, w))[:, 0]  # [B, w]
    cdf = before + inner.to(torch.float64).cumsum(-1)
    j = torch.searchsorted(cdf, target)
    # the block's two sums may differ in their last bits, so the target can lie past the
    # block's running sum: then it is the block's last token of positive mass
    last = w - 1 - (inner > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    return (blk * w + torch.minimum(j, last)).squeeze(-1)
