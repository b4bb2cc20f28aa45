"""Tiny fp32 models and random trees for the tree-training tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.train.synthetic import random_tree
from tidal.train.attention import enable_tree_attention
from tidal.train.loss import LossConfig, per_path_loss
from tidal.train.packing import pack_trees
from tidal.train.trainer import KVCache, build_pair_terms, recompute_logprobs, tree_loss_backward
from tidal.tree.types import TrainTree

VOCAB = 512


# the shape every tiny test model shares (fp32, SDPA)
_SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "attn_implementation": "sdpa"}


def _tiny(config_cls: Any, model_cls: Any, seed: int, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model: torch.nn.Module = model_cls(config_cls(**_SHAPE, **extra)).float()
    return model


def tiny_qwen3(seed: int = 0, *, tied: bool = False) -> torch.nn.Module:
    return _tiny(Qwen3Config, Qwen3ForCausalLM, seed, head_dim=16, tie_word_embeddings=tied)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    return _tiny(Qwen2Config, Qwen2ForCausalLM, seed)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """SmolLM2's architecture (Llama, tied embeddings), small: its decoder builds its
    mask with `create_causal_mask` whatever it is given, unlike Qwen's."""
    return _tiny(LlamaConfig, LlamaForCausalLM, seed, tie_word_embeddings=True)


def random_trees(seed: int, n: int = 3, max_segments: int = 10) -> list[TrainTree]:
    """`n` random trees of two norm groups each (short and long segments)."""
    rng = np.random.default_rng(seed)
    return [
        random_tree(
            rng,
            f"s{seed}-{i}",
            n_segments=int(rng.integers(1, max_segments)),
            max_len=int(rng.choice([3, 16])),
            n_groups=2,
        )
        for i in range(n)
    ]


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


def with_rollout(trees: list[TrainTree], logprobs: list[list[np.ndarray]]) -> list[TrainTree]:
    """Copies of `trees` whose model tokens carry the given rollout log-probabilities."""
    return [
        dataclasses.replace(
            t,
            segments=tuple(
                dataclasses.replace(s, logprobs=np.where(s.model_mask, lp, 0.0).astype(np.float32))
                for s, lp in zip(t.segments, logprobs[ti], strict=True)
            ),
        )
        for ti, t in enumerate(trees)
    ]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the trainable parameters (a LoRA model's adapters)."""
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters() if p.requires_grad
    }


def compare_to_paths(
    model: torch.nn.Module,
    trees: list[TrainTree],
    cfg: LossConfig,
    max_tokens: int,
    *,
    attention: str = "blocks",
    old_noise: float = 0.3,
    ref_model: torch.nn.Module | None = None,
) -> float:
    """Tree loss/grads vs per-path; returns the loss.

    Rollout log-probabilities are set to the model's plus noise (a realistic mismatch),
    and the old ones perturbed too so that the PPO clip is active on some pairs.
    """
    enable_tree_attention(model)
    batch = pack_trees(trees, max_tokens, q_chunk=7)
    gen = torch.Generator().manual_seed(1)
    true = recompute_logprobs(model, batch, attention=attention)
    dev = true.device  # the noise is drawn on the CPU, so that every device gets the same
    rollout = true + 0.2 * torch.randn(true.shape, generator=gen).to(dev)
    trees = with_rollout(trees, batch.to_segment_arrays(rollout.cpu().numpy()))
    batch = pack_trees(trees, max_tokens, q_chunk=7)
    cache = KVCache()
    old = recompute_logprobs(model, batch, attention=attention, kv_cache=cache)
    torch.testing.assert_close(old, true, rtol=0, atol=0)
    old = old + old_noise * torch.randn(old.shape, generator=gen).to(dev)
    ref = None
    ref_seg = None
    if ref_model is not None:
        ref = recompute_logprobs(ref_model, batch, attention=attention)
        ref_seg = batch.to_segment_arrays(ref.cpu().numpy())
    terms = build_pair_terms(batch, old, cfg, ref)
    model.zero_grad()
    loss, _ = tree_loss_backward(model, batch, terms, cfg, cache, attention=attention)
    g_tree = _grads(model)
    model.zero_grad()
    ref_loss = per_path_loss(model, trees, batch.to_segment_arrays(old.cpu().numpy()), cfg,
                             ref_seg)
    ref_loss.backward()
    g_path = _grads(model)
    assert abs(ref_loss.item()) > 0
    np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-5, atol=1e-8)
    if cfg.correction in ("mis", "icepop", "seq_mis", "geo_mis"):
        masked = float((terms.m_P == 0).float().mean())
        assert 0 < masked < 1, masked  # the test exercises both kept and masked pairs
    for name, g in g_path.items():
        assert g.abs().max() > 0 or "q_norm" in name or "k_norm" in name, name
        # fp32, different summation order: rtol 1e-5 per element, with an absolute floor
        # of 1e-5 x the tensor's largest gradient; normwise error below 1e-5 as well
        scale = g.abs().max().item()
        torch.testing.assert_close(g_tree[name], g, rtol=1e-5, atol=1e-5 * scale)
        assert (g_tree[name] - g).norm() <= 1e-5 * g.norm(), name
    return loss


def adam_close(name: str, got: torch.Tensor, want: torch.Tensor, *, lr: float,
               steps: int = 1) -> bool:
    """Parameters after AdamW steps agree to 1e-4 relative, except the key projections'
    biases: their exact gradient is 0 (softmax ignores a shift shared by every key), so
    Adam scales each side's summation noise to a step of up to lr, whatever the machine;
    there the two sides differ by at most what their Adam steps can (2 lr each)."""
    if name.endswith("k_proj.bias"):
        return float((got - want).abs().max()) <= 2 * lr * steps
    return float((got - want).norm() / max(float(want.norm()), 1e-30)) <= 1e-4
