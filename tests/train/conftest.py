"""Tiny fp32 models and random trees for the tree-training tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tidal.tree.types import TrainTree

VOCAB = 512


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).float()


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).float()


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
