"""``/dev/shm`` room for a peer's shared tensors: refused with the fix, never a SIGBUS later."""

from __future__ import annotations

import logging

import pytest
import torch

import p2p_diloco.shared_memory as shm

MIB = 2**20


def test_a_dev_shm_too_small_for_the_steady_need_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda path=shm.SHM_PATH: 64 * MIB)  # Docker's default
    problem = shm.check_room(1_000_000_000, weights_on_cpu=False)
    # 1B parameters: 12 GB steady, 28 GB (26.1 GiB) while downloading the state and applying a missed round
    assert problem is not None and "--shm-size=27g" in problem and "11.18 GiB" in problem, problem
    assert shm.check_room(1_000_000, weights_on_cpu=True) is None  # 16 MB steady fits in 64 MiB


def test_room_for_the_steady_need_only_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                             ) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda path=shm.SHM_PATH: 15 * 10**9)
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        assert shm.check_room(1_000_000_000, weights_on_cpu=False) is None
    assert "state download" in caplog.text


def test_tensors_already_shared_count_as_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda path=shm.SHM_PATH: 10 * MIB)
    need = shm.shared_bytes(1_000_000, weights_on_cpu=False, peak=True)
    assert shm.check_room(1_000_000, weights_on_cpu=False) is not None
    assert shm.check_room(1_000_000, weights_on_cpu=False, already_shared=need) is None


def test_share_before_fork_moves_cpu_tensors_in_place_once() -> None:
    a, b = torch.nn.Parameter(torch.ones(1000)), torch.zeros(10, 10)
    moved = shm.share_before_fork([a, b])
    assert moved == 4000 + 400 and a.is_shared() and b.is_shared() and float(a.detach().sum()) == 1000.0
    assert shm.share_before_fork([a, b]) == 0
