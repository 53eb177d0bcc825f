"""One all-reduce probe peer: a real ``RoundAverager`` averaging a synthetic pseudo-gradient for a few rounds.

Run inside a testbed namespace by ``benchmarks/perf_swarm.py``; writes one JSON object with every round's
measured seconds and bytes. Every peer of a probe group sets ``--group N`` so matchmaking waits for all of
them, and the all-reduce always spans the whole group.

    python -m benchmarks.perf_probe --ip 10.77.0.2 --initial-peers MADDR --group 2 --numel 5500000 --out p.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from p2p_diloco.swarm import RoundAverager, SwarmConfig, start_dht
from p2p_diloco.swarm.hivemind_codecs import wire_compression

FINGERPRINT = "feedc0de12345678"


def template(numel: int, model: str | None) -> list[torch.Tensor]:
    """Either the parameter shapes of a model preset or ``numel`` values cut into 1M-element tensors."""
    if model:
        from p2p_diloco.models import build_model

        return [torch.randn_like(p.detach()) for p in build_model(model, vocab_size=256, seq_len=128).parameters()]
    gen = torch.Generator().manual_seed(0)
    chunk = 1 << 20
    return [torch.randn(min(chunk, numel - i), generator=gen) for i in range(0, numel, chunk)]


def _deeper_prefetch(depth: int) -> None:
    """Experiment only (benchmarks/allreduce_profile.py): every all-reduce runner of this process, the averager
    process forked from it included, reads ``depth`` parts ahead on each stream instead of hivemind's 1."""
    from p2p_diloco.swarm.runner import CountingAllReduceRunner

    original = CountingAllReduceRunner.__init__

    def init(self: CountingAllReduceRunner, **kwargs: object) -> None:
        original(self, **{"prefetch": depth, **kwargs})

    CountingAllReduceRunner.__init__ = init  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(prog="perf_probe")
    parser.add_argument("--ip", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--numel", type=int, default=5_500_000)
    parser.add_argument("--model", default=None, help="use this preset's parameter shapes instead of --numel")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--error-feedback", action="store_true",
                        help="the codec keeps what it did not send, as run_peer --error-feedback (4bit, topk)")
    parser.add_argument("--run-id", default="probe")
    parser.add_argument("--part-size-bytes", type=int, default=SwarmConfig.part_size_bytes)
    parser.add_argument("--prefetch", type=int, default=0,
                        help="experiment: parts each runner decodes ahead per stream (hivemind's prefetch, 1 "
                             "unless set); 0 leaves the runner as it is")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.prefetch:
        _deeper_prefetch(args.prefetch)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # hivemind reports why a reducer's stream ended early only at DEBUG; a benchmark wants the reason
    logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.DEBUG)
    cfg = SwarmConfig(run_id=args.run_id, initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.ip}/tcp/0"],
                      use_relay=False, target_group_size=args.group, min_group_size=args.group,
                      matchmaking_time_s=4.0, matchmaking_timeout_s=120.0, allreduce_timeout_s=300.0,
                      next_chunk_timeout_s=60.0, request_timeout_s=3.0, part_size_bytes=args.part_size_bytes)
    dht = start_dht(cfg)
    tensors = template(args.numel, args.model)
    averager = RoundAverager(tensors, dht, cfg, fingerprint=FINGERPRINT,
                             compression=wire_compression(args.compression, args.error_feedback))
    rounds = []
    for epoch in range(args.rounds):
        began = time.monotonic()
        result = averager.average(tensors, 1.0, 0, epoch)
        # monotonic time is one clock for every process on the machine, namespaces included: the profiler
        # (benchmarks/allreduce_profile.py) places the all-reduce at [ended - allreduce_seconds, ended]
        rounds.append(dict(ended_monotonic=time.monotonic(), outcome=result.outcome, reason=result.reason, group_size=result.group_size,
                           allreduce_seconds=result.allreduce_seconds, wait_seconds=result.wait_seconds,
                           call_seconds=time.monotonic() - began, bytes_sent=result.bytes_sent,
                           bytes_received=result.bytes_received))
    numel = sum(t.numel() for t in tensors)
    args.out.write_text(json.dumps(dict(numel=numel, nbytes=numel * 4, compression=args.compression,
                                        group=args.group, rounds=rounds)))
    averager.shutdown()
    dht.shutdown()
    return 0 if all(r["outcome"] == "averaged" for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
