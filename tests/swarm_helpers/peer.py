"""One swarm peer in its own process, driven by a JSON spec; used by tests/integration/test_swarm_*.py.

Usage: python tests/swarm_helpers/peer.py SPEC.json

Roles:
- "average": join one averaging round and write the RoundResult as JSON (with ``expect_due``, it first
  publishes its progress record, and the round waits for the peers due by the records it reads);
- "donor": serve a (possibly corrupted, for tests) state until ``stop_path`` exists;
- "joiner": download and verify the swarm's state and write what it got;
- "rounds": average ``rounds`` rounds in a row (epochs 0, 1, ...) and write each round's result and the RSS of
  this peer's averager process after it.

Every wait is bounded: files are polled with a deadline and the peer exits on its own.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2

from p2p_diloco.peer.faults import FaultPlan, parse_faults
from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.catchup import download_update
from p2p_diloco.swarm.checksum import combine_state_sha, params_sha256, state_sha256, tensor_manifest
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import start_dht, visible_maddrs
from p2p_diloco.swarm.hivemind_codecs import wire_compression
from p2p_diloco.swarm.quorum import due_peers
from p2p_diloco.swarm.records import fetch_progress, publish_checksum, publish_progress, run_validator
from p2p_diloco.swarm.state import download_state, make_state_metadata
from p2p_diloco.swarm.state_server import ServedUpdate, StateServer

MAX_WAIT_S = 60.0


def pattern(shapes: list[list[int]], value: float) -> list[torch.Tensor]:
    """Deterministic float32 tensors: ``value + 0.001 * index``; also used by the tests for expectations."""
    out = []
    for shape in shapes:
        numel = 1
        for dim in shape:
            numel *= dim
        out.append(
            (torch.arange(numel, dtype=torch.float64) * 0.001 + value).to(torch.float32).reshape(shape)
        )
    return out


def kill_own_process_group(stage: str) -> None:
    """Fault hook: SIGKILL this peer (host, DHT, averager and p2pd share the process group) mid all-reduce."""
    if stage == "part_sent":
        os.killpg(os.getpgrp(), signal.SIGKILL)


def deny_completion(stage: str) -> bool | None:
    """Fault hook: this member claims its all-reduce was incomplete; the whole group must then skip."""
    return False if stage == "confirm" else None


def kill_on_second_chunk(stage: str, served: list[int] = []) -> None:  # noqa: B006 - a counter across calls
    """Fault hook: SIGKILL this donor as it is about to send its second state chunk (a donor dying
    mid-transfer: a joiner asks each donor for two chunks at once, so the second request always comes)."""
    if stage == "state_chunk":
        served.append(1)
        if len(served) == 2:
            os.killpg(os.getpgrp(), signal.SIGKILL)


class FlaggingCompression(NoCompression):
    """A hostile member's codec: hivemind's plain one, with protobuf ``requires_grad`` set on every part and reply
    it sends, which no honest peer does (issue 51, finding 1). The rest of that member is the project's own."""

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        message = super().compress(tensor, info, allow_inplace)
        message.requires_grad = True
        return message


def stall_past_followers_old_deadline(stage: str, fired: list[str] = []) -> None:  # noqa: B006 - fires once
    """Fault hook: as the leader about to form its group, block the averager's event loop (an overloaded
    machine) until every follower's give-up time *without* ``swarm.patience`` has passed: its own declared
    expiration plus ``request_timeout`` (what hivemind's follower waited before). The stall ends on that event,
    read from the followers' own join requests, not after a fixed time; only ``patience`` keeps them waiting."""
    if stage != "assemble" or fired:
        return
    import gc

    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.utils import get_dht_time

    matchmaking = next(o for o in gc.get_objects() if isinstance(o, Matchmaking))
    # hivemind's admission saw each request through ``JoinTiming.leader_view``: its own expiration, patience off
    expirations = [request.expiration for request in matchmaking.current_followers.values()]
    old_deadline = max(expirations, default=get_dht_time()) + matchmaking.request_timeout
    began = get_dht_time()
    while get_dht_time() <= old_deadline and get_dht_time() - began < MAX_WAIT_S:
        time.sleep(0.01)
    fired.append(stage)
    print(f"FAULT FIRED stall_past_followers_old_deadline: {len(expirations)} followers, stalled "
          f"{get_dht_time() - began:.2f} s, {get_dht_time() - old_deadline:.2f} s past their old deadline",
          flush=True)


FAULT_HOOKS = {"kill_on_part_sent": kill_own_process_group, "deny_confirm": deny_completion,
               "kill_on_second_chunk": kill_on_second_chunk,
               "stall_past_followers_old_deadline": stall_past_followers_old_deadline}


def wait_until_declared(averager: RoundAverager, timeout: float = MAX_WAIT_S) -> bool:
    """Poll the DHT until this donor's own state announcement is visible, so joiners can find it."""
    key = f"{averager.prefix}.all_averagers"
    me = averager.peer_id.to_bytes()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = averager.dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and me in found.value:
            return True
        time.sleep(0.1)
    return False


def wait_for_file(path: str, timeout: float = MAX_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(payload))
    os.replace(tmp, path)


def tensors_json(tensors: list[torch.Tensor] | None) -> list[list[float]] | None:
    return None if tensors is None else [t.reshape(-1).tolist() for t in tensors]


def run_average(spec: dict[str, Any], averager: RoundAverager) -> dict[str, Any]:
    shapes = spec["shapes"]
    fresh = pattern(shapes, spec["fresh"]) if spec.get("fresh") is not None else None
    if spec.get("fresh_seed") is not None:  # a random pseudo-gradient, the same size everywhere: N(0, 1) values
        gen = torch.Generator().manual_seed(spec["fresh_seed"])
        fresh = [torch.randn(shape, generator=gen) for shape in shapes]
    stale = pattern(shapes, spec["stale"]) if spec.get("stale") is not None else None
    if spec.get("claim_fingerprint"):
        averager.fingerprint = spec["claim_fingerprint"]  # lies in the gathered metadata only
    due: frozenset[str] = frozenset()
    if spec.get("expect_due"):  # as Swarm.average does, from the records of this run and model
        records = [r for r in fetch_progress(averager.dht, averager.cfg.run_id) if r.fingerprint == spec["fingerprint"]]
        due = due_peers(records, spec.get("epoch", 0))
    result = averager.average(
        fresh,
        weight=spec.get("weight", 1.0),
        staleness=spec.get("staleness", 0),
        epoch=spec.get("epoch", 0),
        stale=stale,
        stale_weight=spec.get("stale_weight", 0.0),
        due=due,
    )
    return dict(
        outcome=result.outcome,
        reason=result.reason,
        group_size=result.group_size,
        contributors=list(result.contributors),
        weights=list(result.weights),
        stale_weights=list(result.stale_weights),
        stalenesses=list(result.stalenesses),
        refused=list(result.refused),
        rejected=list(result.rejected),
        fresh_mean=tensors_json(result.fresh_mean),
        stale_term=tensors_json(result.stale_term),
        fresh_sha=params_sha256(result.fresh_mean) if result.fresh_mean is not None else None,
        stale_sha=params_sha256(result.stale_term) if result.stale_term is not None else None,
        bytes_sent=result.bytes_sent,
        bytes_received=result.bytes_received,
        allreduce_seconds=result.allreduce_seconds,
        wait_seconds=result.wait_seconds,
        due_members=result.due_members,
        cut_members=result.cut_members,
        formed_early=result.formed_early,
        window_s=result.window_s,
        allreduce_deadline_s=result.allreduce_deadline_s,
    )


def base_state(shapes: list[list[int]], value: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The state good donors say their update applies to (any state: the joiner only checks the wire)."""
    return pattern(shapes, value - 1.0), pattern(shapes, value + 99.0)


def serve_state(spec: dict[str, Any], averager: RoundAverager) -> None:
    state = spec["state"]
    params = pattern(spec["shapes"], state["value"])
    opt = pattern(spec["shapes"], state["value"] + 100.0)
    epoch = state["epoch"]
    if state.get("publish_checksum"):
        publish_checksum(averager.dht, averager.cfg.run_id, epoch, state_sha256(params, opt))
    kind = state["kind"]
    if kind == "good":
        # with the update that led to this state from a base state (``swarm.catchup``): value - 1 plus this
        update = ServedUpdate(state_sha256(*base_state(spec["shapes"], state["value"])), pattern(spec["shapes"], 0.5), None)
        StateServer(averager).publish(params, opt, epoch, update=update)
    else:
        served = params + opt
        if kind == "nan":
            params[0][0] = float("nan")
        elif kind == "shape":
            params[0] = params[0].reshape(-1)[:-1].clone()
        elif kind == "tampered":  # self-consistent, but not what the swarm's majority published
            params[0] = params[0] + 1.0
        elif kind == "bad_chunks":  # the honest manifest, but every chunk it sends is altered
            served = [t + 1.0 for t in params + opt]
        pm, om = tensor_manifest(params), tensor_manifest(opt)
        meta = make_state_metadata(averager.cfg.run_id, averager.fingerprint, epoch, combine_state_sha(pm.sha, om.sha),
                                   pm, om, len(params), len(opt))
        if kind != "bad_chunks":
            served = params + opt
        averager.set_state_provider(lambda: ({"s": meta, "u": None}, served))
    averager.state_sharing_priority = float(state["priority"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = SwarmConfig.for_loopback(initial_peers=spec.get("initial_peers", []), **spec.get("cfg", {}))
    dht = start_dht(cfg, record_validators=[run_validator(cfg.run_id)])
    hook = FAULT_HOOKS.get(spec.get("fault", ""))
    if spec.get("faults"):  # run_peer's fault syntax, e.g. "byzantine@0=-20" (p2p_diloco.peer.faults)
        plan = FaultPlan(parse_faults(spec["faults"]), lambda action, epoch: print(f"FAULT FIRED {action}@{epoch}", flush=True))
        plan.set_epoch(spec.get("epoch", 0))
        hook = plan.averager_hook
    template = [torch.zeros(shape) for shape in spec["shapes"]]
    codecs = {
        "none": NoCompression(),
        "float16": Float16Compression(),
        "uniform8bit": Uniform8BitQuantization(),
        "flag_grad": FlaggingCompression(),  # hostile: see FlaggingCompression
    }
    name = spec.get("compression", "none")
    # the project's codecs, installed as run_peer installs them (before the averager process forks)
    compression = codecs[name] if name in codecs else wire_compression(name, error_feedback=True)
    averager = RoundAverager(
        template, dht, cfg, fingerprint=spec["fingerprint"], compression=compression, fault_hook=hook
    )
    out: dict[str, Any] = dict(peer_id=dht.peer_id.to_base58(), maddrs=visible_maddrs(dht))
    role = spec["role"]
    if spec.get("expect_due"):
        publish_progress(dht, cfg.run_id, epoch=spec.get("epoch", 0), inner_step=0, steps_per_s=1.0,
                         samples_per_s=1.0, tokens_per_s=1.0, fingerprint=spec["fingerprint"])
    if role == "donor":
        serve_state(spec, averager)
        out["declared"] = wait_until_declared(averager)
        publish_progress(
            dht,
            cfg.run_id,
            epoch=spec["state"]["epoch"],
            inner_step=0,
            steps_per_s=1.0,
            samples_per_s=1.0,
            tokens_per_s=1.0,
            fingerprint=spec["fingerprint"],
        )
    write_json(spec["ready_path"], out)
    if not wait_for_file(spec["go_path"]):
        out["error"] = "no go signal"
    elif role == "average":
        out.update(run_average(spec, averager))
    elif role == "rounds":  # ``rounds`` rounds in a row, epoch 0, 1, ...: each round's result and the averager's RSS
        out["rounds"] = []
        for epoch in range(spec["rounds"]):
            result = run_average(dict(spec, epoch=epoch), averager)
            result["averager_rss"] = psutil.Process(averager.pid).memory_info().rss
            out["rounds"].append({k: v for k, v in result.items() if k not in ("fresh_mean", "stale_term")})
    elif role == "joiner":
        shapes = spec["shapes"]
        templates = (pattern(shapes, 0.0), pattern(shapes, 0.0))
        partial = Path(spec["partial_dir"]) if spec.get("partial_dir") else None
        state = download_state(averager, *templates, timeout=30.0, partial_dir=partial)
        if state is not None:  # the good donors' update, from the state they name (chunks checked on receipt)
            update = download_update(averager, templates[0], state_sha256(*base_state(shapes, 7.0)), 4, timeout=30.0)
            out["update"] = None if update is None else dict(
                sources=list(update.sources), to=update.result_sha, fresh_sha=params_sha256(update.fresh or []),
                stale=update.stale is not None)
        # every donor serves an epoch below this one: all are rejected and the caller gets None
        out["too_old_result"] = repr(download_state(averager, *templates, min_epoch=10**6, timeout=30.0))
        small = sum(t.numel() for t in templates[0]) <= 1000
        out["state"] = (
            None
            if state is None
            else dict(
                donor=state.donor,
                sources=list(state.sources),
                epoch=state.epoch,
                sha=state.state_sha256,
                received_sha=state_sha256(state.params, state.opt_tensors),  # hashed again from the bytes
                rejected=list(state.rejected),
                params=tensors_json(state.params) if small else None,
                opt=tensors_json(state.opt_tensors) if small else None,
            )
        )
    elif role == "donor":
        wait_for_file(spec["stop_path"])
    if role != "donor":
        write_json(spec["out_path"], out)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
