"""Checks a peer runs once at start: room in ``/dev/shm`` for the tensors it shares with its averager process,
and, on what the swarm's records say, another model or another release."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from p2p_diloco.core.evidence import Evidence
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.shared_memory import check_room, share_before_fork
from p2p_diloco.swarm import SwarmStartError
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


def share_host_state(state: OuterState | Sequence[OuterState], params: list[torch.Tensor]) -> None:
    """Put the host tensors the training process keeps writing (anchors, momentum, a CPU peer's weights) in
    shared memory before ``Swarm.start`` forks the DHT and averager processes, so that those do not keep
    private copies of them (``p2p_diloco.shared_memory``); first check that ``/dev/shm`` holds them
    (``SwarmStartError`` naming the fix when it does not). ``state``: the outer state, or each fragment's."""
    states = [state] if isinstance(state, OuterState) else list(state)
    host = [*(a for s in states for a in s.anchors),
            *(b for s in states for b in s.outer.momentum_buffers() if b is not None),
            *(p for p in params if p.device.type == "cpu")]
    already = sum(t.numel() * t.element_size() for t in host if t.is_shared())
    problem = check_room(sum(s.numel for s in states), weights_on_cpu=any(p.device.type == "cpu" for p in params),
                         already_shared=already)
    if problem is not None:
        raise SwarmStartError(problem)
    share_before_fork(host)


def refuse_other_models(swarm: Swarm, evidence: Evidence, fingerprint: str, run_id: str) -> None:
    """Stop with a clear message when this run's peers all train another model than ours, on evidence.

    Averaging could not mix them anyway (the fingerprint is part of the matchmaking key), but a peer
    that silently trains alone is the worst outcome for a volunteer. A progress record is a free claim,
    though: one record of another fingerprint from a throwaway id would keep every joiner out. So the
    peer stops (``SwarmStartError``) only when a ``--trusted-peers`` peer trains the other model; otherwise
    it warns (naming the fix for a misconfiguration) and starts.
    """
    others = [r for r in swarm.all_records() if r.peer_id != swarm.peer_id]
    if not others or any(r.fingerprint == fingerprint for r in others):
        return
    theirs = sorted({r.fingerprint for r in others})
    message = (f"the {len(others)} peer(s) of run {run_id!r} train a model with fingerprint "
               f"{', '.join(theirs)}, ours is {fingerprint}. Use the run's --model, --seq-len and "
               "--tokenizer, or another --run-id to start a separate run")
    if any(evidence.trusts(r.peer_id) for r in others):
        raise SwarmStartError(f"refused: {message}")
    logger.warning("Starting anyway, as no trusted peer is among them (records are free to forge): %s", message)


def warn_other_versions(swarm: Swarm, run_id: str) -> None:
    """One clear line when peers of this run run another release (``swarm.protocol``): they and this peer
    cannot see each other, so each side averages among its own, and nobody is banned for it. Looked up in
    the background: lookups of keys nobody wrote take a while, and the start must not wait for them."""
    def look() -> None:
        others = swarm.other_versions()
        if others:
            found = ", ".join(f"{n} under protocol version {v}" for v, n in sorted(others.items()))
            logger.warning("Peers of run %r run another release of p2p_diloco (%s; this one speaks version "
                           "%d): they are neither averaged with nor banned. Run one release across the swarm "
                           "(`run_peer doctor` shows it).", run_id, found, PROTOCOL_VERSION)

    threading.Thread(target=look, name="protocol-versions", daemon=True).start()
