"""How many held-open streams a donor survives: hivemind's framing lets a caller hold a server stream for free.

A state donor (a ``RoundAverager`` serving a tiny state through ``StateServer``, the project's own) listens
on loopback. One attacker identity (a bare hivemind ``P2P`` node, as any peer has) opens streams to the
donor's ``rpc_state_chunk`` and holds each open without end, in one of two ways:

- ``no-eos``: a valid request (a manifest request) without the end-of-stream message. hivemind's handler
  wrapper reads the whole request stream before it calls a unary-input handler (``asingle``), so the
  request waits for more, and the project's access checks (per-peer stream caps, bans) have not run yet;
- ``prefix``: a message marker and an 8-byte length prefix of 2^40 bytes, then nothing: hivemind reads that
  many bytes before decoding (``P2P.receive_raw_data``, no cap), so the stream waits for them.

After each batch of held streams, an honest client (another ``P2P`` node) asks the donor for its manifest,
which must arrive within ``--probe-timeout-s``; the donor's averager process and its p2p daemon are sampled
for resident memory and open file descriptors. The run stops at ``--max-streams`` held, or at the first
failed probe, or when the attacker can open no more. ``held`` counts the streams the attacker opened and kept
its end of; ``closed_by_donor`` those the donor ended (``swarm.bounded_rpc``: at once past 8 waiting per peer,
else after ``request_timeout_s``, 1 s on loopback).

Run: ``python -m benchmarks.held_streams [--mode no-eos|prefix] [--max-streams 4000] [--step 500]``; writes
``benchmarks/results/held_streams_<mode>.json`` and ``held_streams.png`` (every result file present). Numbers depend on the machine (file-descriptor limits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.swarm import RoundAverager, StateServer, SwarmConfig, start_dht, visible_maddrs
from p2p_diloco.swarm.chunk_transfer import MANIFEST, encode_request
from p2p_diloco.swarm.dht import ensure_identity

RESULTS = Path(__file__).parent / "results"
FINGERPRINT = "abcdef0123456789"


def _usage(averager: RoundAverager) -> dict[str, Any]:
    """RSS (MiB) and open fds of the donor's averager process and of every p2p daemon under this process."""
    out: dict[str, Any] = {}
    try:
        proc = psutil.Process(averager.pid)
        out["averager_rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
        out["averager_fds"] = proc.num_fds()
    except psutil.Error:
        out["averager_rss_mib"] = out["averager_fds"] = None
    daemons = [p for p in psutil.Process().children(recursive=True) if "p2pd" in p.name()]
    out["p2pd_rss_mib"] = round(sum(p.memory_info().rss for p in daemons) / 2**20, 1)
    out["p2pd_fds"] = sum(p.num_fds() for p in daemons)
    return out


async def _probe(client: P2P, target: PeerID, prefix: str, timeout: float) -> float | None:
    """Seconds an honest manifest request took, or None when it did not arrive within ``timeout``."""
    began = time.monotonic()
    try:
        stub = RoundAverager.get_stub(client, target, namespace=prefix)

        async def first() -> bool:
            request = averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST))
            async for message in await stub.rpc_state_chunk(request):
                return bool(message.metadata)
            return False

        ok = await asyncio.wait_for(first(), timeout)
    except Exception:  # noqa: BLE001 - any failure is a failed probe
        return None
    return time.monotonic() - began if ok else None


async def _hold(attacker: P2P, target: PeerID, name: str, mode: str) -> tuple[Any, Any]:
    _, reader, writer = await attacker.call_binary_stream_handler(target, name)
    try:
        writer.write(P2P.MESSAGE_MARKER)
        if mode == "no-eos":
            await P2P.send_raw_data(averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST))
                                    .SerializeToString(), writer)
        else:
            writer.write((1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            await writer.drain()
    except ConnectionError:
        pass  # the donor closed it before we finished writing: counted in closed_by_donor
    return reader, writer


async def _attack(averager: RoundAverager, mode: str, max_streams: int, step: int,
                  probe_timeout: float) -> dict[str, Any]:
    maddrs = visible_maddrs(averager.dht)
    target = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
    attacker = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    name = f"{averager.prefix}::RoundAverager.rpc_state_chunk"
    held: list[tuple[Any, Any]] = []
    rows = [dict(held=0, probe_s=await _probe(client, target, averager.prefix, probe_timeout), **_usage(averager))]
    stopped = "max_streams"
    try:
        while len(held) < max_streams:
            try:
                batch = await asyncio.gather(*(_hold(attacker, target, name, mode) for _ in range(step)))
            except Exception as e:  # noqa: BLE001 - the attacker's side ran out first
                stopped = f"the attacker could open no more streams: {type(e).__name__}: {e}"[:300]
                break
            held.extend(batch)
            await asyncio.sleep(1.0)
            row = dict(held=len(held), closed_by_donor=sum(reader.at_eof() for reader, _ in held),
                       probe_s=await _probe(client, target, averager.prefix, probe_timeout), **_usage(averager))
            rows.append(row)
            print(row, flush=True)
            if row["probe_s"] is None:
                stopped = "an honest manifest request failed"
                break
    finally:
        for _, writer in held:
            writer.close()
        await attacker.shutdown()
        await client.shutdown()
    return dict(rows=rows, stopped=stopped)


def plot(results: Path = RESULTS) -> Path:
    """``held_streams.png``: the donor averager's open descriptors against streams the attacker opened, for each
    result file present (``*_unbounded.json``: hivemind's own wrapper, before ``swarm.bounded_rpc``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in sorted(results.glob("held_streams_*.json")):
        rows = [r for r in json.loads(path.read_text())["rows"] if r.get("averager_fds") is not None]
        label = path.stem.removeprefix("held_streams_")
        ax.plot([r["held"] for r in rows], [r["averager_fds"] for r in rows], marker=".", label=label)
    ax.set_xlabel("streams opened and held by one attacker identity")
    ax.set_ylabel("donor averager process: open fds")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Held-open streams: unbounded (hivemind's wrapper) vs bounded")
    out = results / "held_streams.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("no-eos", "prefix"), default="no-eos")
    parser.add_argument("--max-streams", type=int, default=4000)
    parser.add_argument("--step", type=int, default=500)
    parser.add_argument("--probe-timeout-s", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        key = str(Path(work) / "donor.key")
        ensure_identity(key)
        cfg = SwarmConfig.for_loopback(run_id="held", identity_path=key)
        dht = start_dht(cfg)
        averager = RoundAverager([torch.zeros(1024)], dht, cfg, fingerprint=FINGERPRINT)
        StateServer(averager).publish([torch.ones(1024)], [torch.zeros(1024)], epoch=2)
        try:
            result = asyncio.run(_attack(averager, args.mode, args.max_streams, args.step, args.probe_timeout_s))
        finally:
            averager.shutdown()
            dht.shutdown()
    result.update(mode=args.mode, fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0], host=platform.node(),
                  cpus=psutil.cpu_count())
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"held_streams_{args.mode}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), f"-> {out}", f"and {plot()}")


if __name__ == "__main__":
    main()
