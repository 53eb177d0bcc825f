"""A poisoner of missed rounds: one identity that follows the honest swarm round by round and, for each round,
serves a poisoned update of it together with the state that update leads to, so that a peer one round behind
that can reach no honest donor applies a self-consistent poison and, failing that, downloads it whole.

Usage: python tests/swarm_helpers/poisoner.py MADDR RUN_ID WORKDIR OUT.json

Built from the project's own parts, as ``relay.py``: a DHT node and a ``RoundAverager`` of the run's model,
``download_state`` / ``download_update`` to follow the honest swarm exactly as a joiner does. After each honest
round ``E - 1 -> E`` it keeps the honest states, adds noise to the round's fresh mean, applies that poisoned
update to the honest state of ``E - 1`` with the outer step every member runs, and serves the result as the
state of epoch ``E`` (with its checksum published) and the poisoned update as the round that led there, at a
self-declared priority of 10^6. Everything hashes to what it claims: a catch-up that trusted the update's
donor, or a download that trusted the state's, would load it. It publishes no progress record.

OUT.json: ``{"peer_id", "epoch": the honest epoch followed, "poisoned": {epoch: params sha256 of the poisoned
state served for it}, "served": manifests handed out}``, rewritten as it goes, until SIGTERM.
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
from p2p_diloco.swarm.checksum import state_sha256, tensor_manifest
from p2p_diloco.swarm.dht import ensure_identity
from p2p_diloco.swarm.records import fetch_progress, publish_checksum, run_validator
from p2p_diloco.swarm.state import download_state
from p2p_diloco.swarm.state_server import ServedUpdate

PRIORITY = 1e6
NOISE = 0.05
VOCAB, SEQ_LEN = 259, 64  # the tests' --model tiny --seq-len 64 with the byte tokenizer
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # run_peer's defaults


def _step(anchors: list[torch.Tensor], momentum: list[torch.Tensor], fresh: list[torch.Tensor] | None,
          stale: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of ``anchors`` and ``momentum`` stepped by a round's update, as every member steps."""
    stepped = [a.clone() for a in anchors]
    outer = OuterOptimizer(stepped, lr=OUTER_LR, momentum=OUTER_MOMENTUM)
    outer.load_state_tensors({f"{MOMENTUM_KEY_PREFIX}{i}": m.clone() for i, m in enumerate(momentum)}, take=True)
    apply_round(outer, RoundAggregate(fresh, stale, None))  # type: ignore[arg-type]
    return stepped, list(outer.momentum_buffers())


def _declared(averager: RoundAverager) -> object:
    """This averager's own entry in the donor directory, as the DHT returns it now."""
    found = averager.dht.get(f"{averager.prefix}.all_averagers", latest=True)
    entry = found.value.get(averager.peer_id.to_bytes()) if found is not None and isinstance(found.value, dict) else None
    return getattr(entry, "value", None)


def main() -> None:
    maddr, run, workdir, out_path = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    workdir.mkdir(parents=True, exist_ok=True)
    identity = str(workdir / "poisoner.id")
    report: dict[str, Any] = {"peer_id": ensure_identity(identity), "epoch": None, "poisoned": {}, "served": 0}
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
    torch.manual_seed(0)
    state = None
    while not stopping and time.monotonic() < deadline:
        if state is None:
            state = download_state(averager, template, [torch.zeros_like(t) for t in template], timeout=20)
            if state is not None:
                anchors, momentum, epoch, sha = state.params, state.opt_tensors, state.epoch, state.state_sha256
                report["epoch"] = epoch
            continue
        report["served"] = server.served
        write_report(out_path, report)
        update = download_update(averager, anchors, sha, epoch, timeout=5)
        if update is None:
            honest = max((r.epoch for r in fetch_progress(dht, run) if r.fingerprint == fingerprint), default=epoch)
            if honest > epoch + 1:  # it fell behind: a whole state again
                state = None
            time.sleep(0.1)
            continue
        stepped, new_momentum = _step(anchors, momentum, update.fresh, update.stale)
        new_sha = state_sha256(stepped, new_momentum)
        if new_sha != update.result_sha:
            continue
        # the poison: the same round with noise on its terms, applied to the same honest base
        fresh = [t + NOISE * torch.randn_like(t) for t in update.fresh] if update.fresh else None
        stale = [t + NOISE * torch.randn_like(t) for t in update.stale] if update.stale else None
        forged, forged_momentum = _step(anchors, momentum, fresh, stale)
        server.withdraw(0.0)
        forged_sha = server.publish(forged, forged_momentum, epoch + 1, update=ServedUpdate(sha, fresh, stale))
        averager.state_sharing_priority = PRIORITY
        publish_checksum(dht, run, epoch + 1, forged_sha, ttl_s=300)
        anchors, momentum, epoch, sha = stepped, new_momentum, epoch + 1, new_sha  # the honest state, followed
        # reported once its directory entry is readable: the test cuts the honest donors off at this report, and
        # a declaration still in flight then (stores to frozen DHT nodes) could land after its withdrawal's
        for _ in range(50):
            if _declared(averager) == PRIORITY:
                break
            time.sleep(0.1)
        report["epoch"] = epoch
        report["poisoned"][str(epoch)] = tensor_manifest(forged).sha
        write_report(out_path, report)


if __name__ == "__main__":
    try:
        main()
    finally:
        # os._exit skips multiprocessing's exit handlers: the averager and DHT processes outlive this one (until
        # the suite's reaper) and keep declaring it a donor at PRIORITY while answering nothing. The test relies
        # on that silent directory entry: a peer that crashed leaves one too (core.chunks.manifest_wait_s).
        os._exit(0)
