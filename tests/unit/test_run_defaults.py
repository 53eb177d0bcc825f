"""Settings a run gets when the user leaves them out: the outer lr and momentum (``core.outer_defaults``) and
the evaluation cadence (``config.default_eval_every``)."""

from __future__ import annotations

import argparse

import pytest

from p2p_diloco.config import EVAL_BATCH_COST, EVAL_SHARE, OuterConfig, TrainConfig, default_eval_every
from p2p_diloco.config_loader import ConfigError, add_arguments, build
from p2p_diloco.core.outer_defaults import SMALL_H, choose_outer


@pytest.mark.parametrize("h, k, overlap, lr, momentum", [
    (20, 3, "none", 1.0, 0.0),  # the issue's run: the sweeps' best at H = 5-50, k = 2-8
    (5, 8, "none", 1.0, 0.0),
    (SMALL_H - 1, 2, "none", 1.0, 0.0),
    (20, 4, "eager", 0.7, 0.0),  # eager's own sweep
    (SMALL_H, 1, "none", 0.4, 0.9),  # the scaling-law study's lr by replicas
    (500, 2, "none", 0.6, 0.9),
    (500, 7, "eager", 0.6, 0.9),
    (500, 8, "none", 0.7, 0.9),  # the DiLoCo paper's own setting
    (500, 64, "none", 0.7, 0.9),
])
def test_the_rule_picks_by_h_peers_and_overlap(h: int, k: int, overlap: str, lr: float, momentum: float) -> None:
    choice = choose_outer(h, k, overlap)
    assert (choice.lr, choice.momentum, choice.chosen) == (lr, momentum, ("lr", "momentum"))
    assert f"H = {h}" in choice.describe()


def test_a_value_given_always_wins_and_the_other_is_still_chosen() -> None:
    assert (choose_outer(20, 4, lr=0.5).lr, choose_outer(20, 4, lr=0.5).momentum) == (0.5, 0.0)
    only_momentum = choose_outer(500, 8, momentum=0.5)
    assert (only_momentum.lr, only_momentum.momentum, only_momentum.chosen) == (0.7, 0.5, ("lr",))
    both = choose_outer(20, 4, lr=0.7, momentum=0.9)
    assert (both.lr, both.momentum, both.chosen) == (0.7, 0.9, ())
    assert "both given" in both.describe()


def test_the_config_applies_the_rule_and_keeps_explicit_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    auto = build(TrainConfig, parser.parse_args(["--local-steps", "20"]), environ={})
    assert (auto.outer.lr, auto.outer.momentum) == (1.0, 0.0)
    assert auto.outer.choice is not None and auto.outer.choice.chosen == ("lr", "momentum")
    paper = build(TrainConfig, parser.parse_args([]), environ={})  # H = 500, k = 8: the paper's settings
    assert (paper.outer.lr, paper.outer.momentum) == (0.7, 0.9)
    given = build(TrainConfig, parser.parse_args(["--local-steps", "20", "--outer-lr", "0.7", "--outer-momentum",
                                                  "0.9"]), environ={})
    assert (given.outer.lr, given.outer.momentum) == (0.7, 0.9) and given.outer.choice.chosen == ()
    env = build(TrainConfig, parser.parse_args(["--local-steps", "20"]), environ={"P2P_DILOCO_OUTER_MOMENTUM": "0.5"})
    assert (env.outer.lr, env.outer.momentum) == (1.0, 0.5)
    few = build(TrainConfig, parser.parse_args(["--expected-peers", "2"]), environ={})
    assert (few.outer.lr, few.outer.momentum) == (0.6, 0.9)


def test_bad_values_are_refused_with_the_flag_named() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    with pytest.raises(ConfigError, match="--expected-peers"):
        build(TrainConfig, parser.parse_args(["--expected-peers", "0"]), environ={})
    with pytest.raises(ConfigError, match="--outer-lr"):
        build(TrainConfig, parser.parse_args(["--outer-lr", "0"]), environ={})
    with pytest.raises(ValueError):
        choose_outer(0, 4)
    assert OuterConfig(local_steps=20).lr == 1.0


@pytest.mark.parametrize("h, batches, every", [(20, 8, 5), (10, 2, 3), (100, 8, 1), (500, 8, 1), (5, 8, 18), (20, 1, 1)])
def test_the_default_eval_cadence_keeps_evaluation_cheap(h: int, batches: int, every: int) -> None:
    assert default_eval_every(h, batches) == every
    # the cost the cadence promises: evaluation batches per inner step under EVAL_SHARE, one round fewer not
    assert batches * EVAL_BATCH_COST <= EVAL_SHARE * h * every + 1e-9
    if every > 1:
        assert batches * EVAL_BATCH_COST > EVAL_SHARE * h * (every - 1)


def test_the_eval_cadence_is_chosen_only_when_not_given() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    assert build(TrainConfig, parser.parse_args(["--local-steps", "20"]), environ={}).run.eval_every == 5
    assert build(TrainConfig, parser.parse_args([]), environ={}).run.eval_every == 1  # H = 500
    for given in ("0", "1", "3"):
        cfg = build(TrainConfig, parser.parse_args(["--local-steps", "20", "--eval-every", given]), environ={})
        assert cfg.run.eval_every == int(given)
