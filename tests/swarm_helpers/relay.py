"""A relay that turns capturer: one identity that serves the honest swarm's own state and round updates, listed
first (a self-declared donor priority of 10^6), then, once told, serves a state of its own making at a future
epoch with everything that makes it look right.

Usage: python tests/swarm_helpers/relay.py MADDR RUN_ID WORKDIR OUT.json

Built from the project's own parts: a DHT node and a ``RoundAverager`` of the run's model (read from the honest
records), ``download_state`` / ``download_update`` to follow the honest swarm round by round exactly as a
joiner does (each step checked against the digest the honest donors claim), and a ``StateServer`` that serves
the honest state and the update that led to it, so that a peer one round behind fetches the update's chunks
from it too. When WORKDIR/capture exists it stops following and serves the honest state plus noise as epoch
``honest + CAPTURE_LEAP``, with that state's checksum published and a signed progress record claiming it,
renewed every second: before the fix, a peer that had applied an update listing this relay first trusted it,
believed the claim, loaded that state, and the peers trusting that peer followed.

OUT.json: ``{"peer_id", "epoch", "followed": rounds followed, "served": manifests handed out, "claimed": the
epoch claimed once capturing}``, rewritten as it goes, until SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from reports import write_report  # sibling module: these scripts run as files

from p2p_diloco.core.delayed import RoundAggregate, apply_round
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX, OuterOptimizer
from p2p_diloco.models import build_model, model_fingerprint
from p2p_diloco.swarm import RoundAverager, StateServer, SwarmConfig, start_dht
from p2p_diloco.swarm.catchup import download_update
from p2p_diloco.swarm.checksum import state_sha256
from p2p_diloco.swarm.dht import ensure_identity
from p2p_diloco.swarm.records import fetch_progress, publish_checksum, publish_progress, run_validator
from p2p_diloco.swarm.state import download_state
from p2p_diloco.swarm.state_server import ServedUpdate

PRIORITY = 1e6
CAPTURE_LEAP = 1000
VOCAB, SEQ_LEN = 259, 64  # the tests' --model tiny --seq-len 64 with the byte tokenizer
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # run_peer's defaults


def main() -> None:
    maddr, run, workdir, out_path = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    workdir.mkdir(parents=True, exist_ok=True)
    identity = str(workdir / "relay.id")
    report: dict[str, Any] = {"peer_id": ensure_identity(identity), "epoch": None, "followed": 0, "served": 0,
                              "claimed": None}
    write_report(out_path, report)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    cfg = SwarmConfig.for_loopback(run_id=run, identity_path=identity, initial_peers=[maddr],
                                   next_chunk_timeout_s=5.0)
    dht = start_dht(cfg, record_validators=[run_validator(run)])
    model = build_model("tiny", VOCAB, SEQ_LEN)
    fingerprint = model_fingerprint(model, "tiny")
    template = [p.detach().clone() for p in model.parameters()]
    deadline = time.monotonic() + 600
    while not stopping and time.monotonic() < deadline and not any(
            r.fingerprint == fingerprint for r in fetch_progress(dht, run)):
        time.sleep(0.5)
    averager = RoundAverager(template, dht, cfg, fingerprint=fingerprint)
    server = StateServer(averager)
    state = None
    while not stopping and time.monotonic() < deadline and state is None:
        state = download_state(averager, template, [torch.zeros_like(t) for t in template], timeout=20)
    if state is None:
        return
    anchors, momentum, epoch, sha = state.params, state.opt_tensors, state.epoch, state.state_sha256
    server.publish(anchors, momentum, epoch)
    averager.state_sharing_priority = PRIORITY
    report["epoch"] = epoch
    capture = workdir / "capture"
    while not stopping and time.monotonic() < deadline and not capture.exists():
        report["served"] = server.served
        write_report(out_path, report)
        # Asked at once, not when the records say so: a donor serves a round's update for one inner phase only.
        update = download_update(averager, anchors, sha, epoch, timeout=5)
        if update is None:
            honest = max((r.epoch for r in fetch_progress(dht, run) if r.fingerprint == fingerprint), default=epoch)
            if honest > epoch + 1:  # it fell behind: a whole state again
                got = download_state(averager, template, [torch.zeros_like(t) for t in template], timeout=20)
                if got is not None:
                    server.withdraw(0.0)
                    anchors, momentum, epoch, sha = got.params, got.opt_tensors, got.epoch, got.state_sha256
                    server.publish(anchors, momentum, epoch)
                    averager.state_sharing_priority = PRIORITY
            time.sleep(0.1)
            continue
        stepped = [a.clone() for a in anchors]
        outer = OuterOptimizer(stepped, lr=OUTER_LR, momentum=OUTER_MOMENTUM)
        outer.load_state_tensors({f"{MOMENTUM_KEY_PREFIX}{i}": m.clone() for i, m in enumerate(momentum)}, take=True)
        apply_round(outer, RoundAggregate(update.fresh, update.stale, None))
        new_momentum = list(outer.momentum_buffers())
        new_sha = state_sha256(stepped, new_momentum)
        if new_sha != update.result_sha:
            continue
        server.withdraw(0.0)
        base, anchors, momentum, epoch, sha = sha, stepped, new_momentum, epoch + 1, new_sha
        # the honest update, served from this relay too (its buffers are kept until the next step)
        server.publish(anchors, momentum, epoch, update=ServedUpdate(base, update.fresh, update.stale))
        averager.state_sharing_priority = PRIORITY
        report["epoch"], report["followed"] = epoch, report["followed"] + 1
    if stopping or not capture.exists():
        return
    # Capture: a state of its own making, at a future epoch, self-consistent: checksum and record to match.
    server.withdraw(0.0)
    torch.manual_seed(0)
    forged = [a + 0.5 * torch.randn_like(a) for a in anchors]
    claimed = epoch + CAPTURE_LEAP
    forged_sha = server.publish(forged, momentum, claimed)
    averager.state_sharing_priority = PRIORITY
    report["claimed"] = claimed
    while not stopping and time.monotonic() < deadline:
        publish_checksum(dht, run, claimed, forged_sha, ttl_s=30)
        publish_progress(dht, run, epoch=claimed, inner_step=0, steps_per_s=1.0, samples_per_s=4.0,
                         tokens_per_s=256.0, fingerprint=fingerprint, ttl_s=30)
        report["served"] = server.served
        write_report(out_path, report)
        time.sleep(1.0)



if __name__ == "__main__":
    try:
        main()
    finally:
        os._exit(0)  # the averager and DHT processes are daemons: they go with this one
