"""The all-reduce profiler's arithmetic (benchmarks/link_profile.py) on synthetic counter series: busy and idle
seconds of a link, where the idle time lies, and the link-bound / CPU-bound / waiting split."""

from __future__ import annotations

import pytest

from benchmarks.link_profile import cpu_overlap, cpu_seconds, link_activity

RATE = 1000.0  # bytes per second


def _counter(pattern: list[tuple[float, float]], dt: float = 0.05) -> tuple[list[float], list[float]]:
    """Cumulative bytes sampled every ``dt`` from ``[(seconds, fraction of RATE), ...]``."""
    t, v = [0.0], [0.0]
    for seconds, fraction in pattern:
        for _ in range(round(seconds / dt)):
            t.append(t[-1] + dt)
            v.append(v[-1] + fraction * RATE * dt)
    return t, v


def test_busy_idle_and_where_the_idle_time_lies() -> None:
    # 1 s idle, 2 s flat out, 0.5 s idle, 1 s at half rate, 1 s flat out, 1 s idle
    t, v = _counter([(1, 0), (2, 1), (0.5, 0), (1, 0.5), (1, 1), (1, 0)])
    a = link_activity(t, v, RATE, 0.0, 6.5)
    assert a["busy_s"] == pytest.approx(3.0)
    assert a["partial_s"] == pytest.approx(1.0)
    assert a["idle_s"] == pytest.approx(2.5)
    assert (a["idle_head_s"], a["idle_middle_s"], a["idle_tail_s"]) == pytest.approx((1.0, 0.5, 1.0))
    assert a["gaps"] == [[0.0, 1.0], [3.0, 0.5], [5.5, 1.0]]
    assert a["utilization"] == pytest.approx(3.5 / 6.5)
    assert a["bytes"] == pytest.approx(3500.0)


def test_window_between_samples_is_interpolated() -> None:
    t, v = _counter([(2, 1)])
    a = link_activity(t, v, RATE, 0.525, 1.525)  # both ends fall between samples
    assert a["bytes"] == pytest.approx(1000.0) and a["busy_s"] == pytest.approx(1.0) and a["gaps"] == []


def test_short_stalls_count_as_idle_but_are_not_listed() -> None:
    t, v = _counter([(1, 1), (0.1, 0), (1, 1)])
    a = link_activity(t, v, RATE, 0.0, 2.1)
    assert a["idle_s"] == pytest.approx(0.1) and a["gaps"] == []


def test_link_cpu_and_waiting_split() -> None:
    # a link flat out for 1 s; then 1 s with every link idle and 2 cores saturated; then 1 s idle, CPU 0.5 core
    link = _counter([(1, 1), (2, 0)])
    other = _counter([(3, 0)])
    cpu_t, cpu = _counter([(1, 0.0005), (1, 0.002), (1, 0.0005)])  # cumulative CPU s (RATE scales to cores)
    split = cpu_overlap([link, other], RATE, cpu_t, cpu, cores=2, begin=0.0, end=3.0)
    assert split["link_bound_s"] == pytest.approx(1.0)
    assert split["cpu_bound_s"] == pytest.approx(1.0)
    assert split["neither_s"] == pytest.approx(1.0)
    assert split["cpu_saturated_s"] == pytest.approx(1.0)
    assert split["busy_links_s"] == pytest.approx([2.0, 1.0, 0.0])
    assert cpu_seconds(cpu_t, cpu, 0.0, 3.0) == pytest.approx(3.0)


def test_empty_window_is_refused() -> None:
    t, v = _counter([(1, 1)])
    with pytest.raises(ValueError, match="end > begin"):
        link_activity(t, v, RATE, 1.0, 1.0)
