"""The trajectory processor: ledger calls -> session trees -> TrainTrees (docs/trees.md)."""

from tidal.tree.episode import EDGE_KINDS, Edge, EpisodeGraph, SessionData, load_sessions
from tidal.tree.process import (
    TRAIN_REWARDS,
    EpisodeReport,
    ProcessResult,
    balance_advantages,
    process_sessions,
    process_store,
    with_rewards,
)
from tidal.tree.trie import SessionTrie, TreeError, build_trie
from tidal.tree.types import Branch, Segment, TrainTree
from tidal.tree.weights import token_weights

__all__ = [
    "EDGE_KINDS",
    "TRAIN_REWARDS",
    "Branch",
    "Edge",
    "EpisodeGraph",
    "EpisodeReport",
    "ProcessResult",
    "Segment",
    "SessionData",
    "SessionTrie",
    "TrainTree",
    "TreeError",
    "balance_advantages",
    "build_trie",
    "load_sessions",
    "process_sessions",
    "process_store",
    "token_weights",
    "with_rewards",
]
