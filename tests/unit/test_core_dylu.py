"""Dynamic Local Updates: steps from speeds, smoothing, noise rejection, ageing out."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.core.dylu import DyLU, late_start_steps, phase_elapsed_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_from_speeds() -> None:
    dylu = DyLU(target_steps=100, min_steps=5, clock=FakeClock())
    dylu.observe("fast", 10.0)
    assert dylu.local_steps(10.0) == 100
    assert dylu.local_steps(5.0) == 50
    assert dylu.local_steps(7.0) == 70
    assert dylu.local_steps(10.0 / 3.0) == 33
    # Faster than every known peer: self is v_max.
    assert dylu.local_steps(40.0) == 100


def test_floor_applies_to_very_slow_peers() -> None:
    dylu = DyLU(target_steps=100, min_steps=5, clock=FakeClock())
    dylu.observe("fast", 100.0)
    assert dylu.local_steps(1.0) == 5
    assert dylu.local_steps(6.5) == 6


def test_unknown_own_speed_runs_target_steps() -> None:
    dylu = DyLU(target_steps=64, clock=FakeClock())
    dylu.observe("fast", 100.0)
    assert dylu.local_steps(None) == 64
    assert dylu.local_steps(math.nan) == 64
    assert dylu.local_steps(0.0) == 64


def test_ema_smooths_a_noisy_reading() -> None:
    dylu = DyLU(target_steps=100, alpha=0.25, clock=FakeClock())
    dylu.observe("peer", 8.0)
    dylu.observe("peer", 16.0)  # one noisy reading moves the estimate only a quarter of the way
    assert dylu.speed("peer") == pytest.approx(10.0)
    dylu.observe("peer", 8.0)
    assert dylu.speed("peer") == pytest.approx(9.5)


@pytest.mark.parametrize("reading", [math.nan, math.inf, -math.inf, 0.0, -3.0])
def test_invalid_readings_are_ignored(reading: float) -> None:
    dylu = DyLU(target_steps=100, clock=FakeClock())
    assert dylu.observe("peer", 4.0)
    assert not dylu.observe("peer", reading)
    assert not dylu.observe("other", reading)
    assert dylu.speeds() == {"peer": 4.0}


def test_silent_peers_age_out() -> None:
    clock = FakeClock()
    dylu = DyLU(target_steps=100, max_age_s=60.0, clock=clock)
    dylu.observe("fast", 20.0)
    clock.now = 30.0
    dylu.observe("slow", 5.0)
    assert dylu.local_steps(5.0) == 25
    clock.now = 61.0  # "fast" last heard at t=0: gone; "slow" heard at t=30: kept
    assert dylu.speeds() == {"slow": 5.0}
    assert dylu.local_steps(5.0) == 100
    # An explicit `now` overrides the clock.
    assert dylu.speed("slow", now=200.0) is None


def test_forget_and_fastest() -> None:
    dylu = DyLU(target_steps=10, clock=FakeClock())
    assert dylu.fastest() is None
    dylu.observe("a", 3.0)
    dylu.observe("b", 7.0)
    assert dylu.fastest() == 7.0
    assert dylu.fastest(my_speed=9.0) == 9.0
    dylu.forget("b")
    assert dylu.fastest() == 3.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_steps": 0},
        {"target_steps": 10, "min_steps": 11},
        {"target_steps": 10, "min_steps": 0},
        {"target_steps": 10, "alpha": 0.0},
        {"target_steps": 10, "alpha": 1.5},
        {"target_steps": 10, "max_age_s": 0.0},
    ],
)
def test_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DyLU(**kwargs)  # type: ignore[arg-type]


def test_late_start_plans_half_of_what_the_swarm_has_left() -> None:
    assert late_start_steps(100, 4.0, 5.0, 10) == 40  # 4 s late at 5 steps/s: 80 left, half of them
    assert late_start_steps(100, 4.0, 5.0, 10, aim=1.0) == 80
    assert late_start_steps(100, 4.9, 5.0, 10, aim=1.0) == 75  # whole steps only, rounded towards arriving early
    assert late_start_steps(100, 60.0, 5.0, 10) == 10  # never below min_steps
    for speed in (None, 0.0, -1.0, float("nan"), float("inf")):
        assert late_start_steps(100, 4.0, speed, 10) == 100  # no usable speed: unchanged
    assert late_start_steps(100, 0.0, 5.0, 10) == 100
    assert late_start_steps(100, float("nan"), 5.0, 10) == 100


def test_phase_elapsed_is_the_median_of_the_records_within_bounds() -> None:
    assert phase_elapsed_s([]) is None
    assert phase_elapsed_s([(10.0, 2.0)]) == 12.0
    assert phase_elapsed_s([(10.0, 2.0), (11.0, 1.0), (1e6, 0.0)]) == 12.0  # one liar among three moves nothing
    assert phase_elapsed_s([(10.0, -5.0), (10.0, 1e9)], max_age_s=20.0) == 20.0  # ages clamped to [0, 20]
    assert phase_elapsed_s([(float("nan"), 1.0), (-1.0, 1.0), (3.0, float("inf"))]) is None
