"""The network-free algorithm core: outer optimizer, delayed updates, DyLU, eager step, codecs.

Nothing here touches the network or imports hivemind (the adapter that puts the codecs on hivemind's
wire is :mod:`p2p_diloco.swarm.hivemind_codecs`), so the simulator and the swarm run the very same
update rules.
"""

from __future__ import annotations

from p2p_diloco.core.codecs import CODEC_NAMES, Codec, ErrorFeedback, get_codec
from p2p_diloco.core.delayed import (
    Contribution,
    DelayedNesterov,
    NaiveAsyncNesterov,
    RoundAggregate,
    RoundStats,
    StalenessPolicy,
    aggregate_round,
    apply_round,
    contribution_scales,
    delayed_outer_step,
    fold_scales,
    group_stats,
    summarize_round,
)
from p2p_diloco.core.dylu import DyLU
from p2p_diloco.core.eager import EagerOuterStep
from p2p_diloco.core.outer import (
    OuterOptimizer,
    build_outer_optimizer,
    fedavg_outer_optimizer,
    make_anchors,
    nesterov_outer_optimizer,
)
from p2p_diloco.core.pseudograd import all_finite, pseudo_gradient, weighted_mean

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "Contribution",
    "DelayedNesterov",
    "DyLU",
    "EagerOuterStep",
    "ErrorFeedback",
    "NaiveAsyncNesterov",
    "OuterOptimizer",
    "RoundAggregate",
    "RoundStats",
    "StalenessPolicy",
    "aggregate_round",
    "all_finite",
    "apply_round",
    "build_outer_optimizer",
    "contribution_scales",
    "fold_scales",
    "group_stats",
    "delayed_outer_step",
    "fedavg_outer_optimizer",
    "get_codec",
    "make_anchors",
    "nesterov_outer_optimizer",
    "pseudo_gradient",
    "summarize_round",
    "weighted_mean",
]
