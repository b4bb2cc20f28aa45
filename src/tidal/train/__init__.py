"""tidal.train: DFS tree packing, ancestor-masked attention, PPO/GRPO loss with
importance correction, and the tree trainer (see docs/training.md)."""

from tidal.train.attention import StreamPlan, enable_tree_attention
from tidal.train.loss import CORRECTIONS, LossConfig, pair_correction, pair_loss, per_path_loss
from tidal.train.merge import merge_trees
from tidal.train.packing import PackedBatch, PackedStream, TreeTrainingError, pack_trees
from tidal.train.trainer import (
    KVCache,
    StepMetrics,
    TreeTrainer,
    build_pair_terms,
    mismatch_metrics,
    recompute_logprobs,
    tree_loss_backward,
)

__all__ = [
    "CORRECTIONS",
    "KVCache",
    "LossConfig",
    "PackedBatch",
    "PackedStream",
    "StepMetrics",
    "StreamPlan",
    "TreeTrainer",
    "TreeTrainingError",
    "build_pair_terms",
    "enable_tree_attention",
    "merge_trees",
    "mismatch_metrics",
    "pack_trees",
    "pair_correction",
    "pair_loss",
    "per_path_loss",
    "recompute_logprobs",
    "tree_loss_backward",
]
