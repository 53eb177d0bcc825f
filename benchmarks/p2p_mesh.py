"""The all-reduce's traffic through the p2p daemons, without the all-reduce: the floor of hivemind's transport.

``allreduce_profile`` compares the all-reduce with two floors made of kernel TCP: one bulk flow (1.045x the
bound) and a mesh in which every host sends ``2 S / N`` to every other at once (1.11-1.15x). The all-reduce
itself took 1.28-1.40x. This measures the step between: the same bytes, in the all-reduce's own stream
pattern, through libp2p streams of the p2p daemons that hivemind's all-reduce uses, with no reduction and no
dependency between streams. Each host opens one stream to every other host (``P2P.iterate_protobuf_handler``,
as the all-reduce sends its parts) and sends ``S / N`` in parts of ``part_bytes``; the handler on the other
end streams ``S / N`` back at once on the same stream (as a reducer sends its averaged parts), so each
uplink carries ``2 (N - 1) / N x S``, as in the all-reduce.

- If this mesh takes about what the all-reduce takes, the transport is the limit, not the all-reduce's
  schedule (reply interleave, prefetch, the wait for every sender's part).
- If it is close to the kernel TCP mesh, the missing time is the all-reduce's own.

    sudo .venv/bin/python -m benchmarks.perf_swarm p2p_mesh       # N=4 at 20 and 100 Mbit/s, 3 runs each
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path

HANDLER = "p2p_diloco_bench_mesh"


async def _probe(me: str, boot: str, out: Path, index: int, n: int, nbytes: int,
                 part_bytes: int) -> dict[str, float]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2, runtime_pb2

    part = runtime_pb2.Tensor(buffer=bytes(part_bytes), dtype="uint8")
    parts = max(1, -(-nbytes // part_bytes))

    async def stream_parts():
        for _ in range(parts):
            yield averaging_pb2.AveragingData(tensor_part=part)

    received: dict[str, float] = {}

    async def handler(requests, context):
        async def drain() -> None:
            async for _ in requests:
                pass
            received[context.remote_id.to_base58()] = time.monotonic()
        draining = asyncio.create_task(drain())
        async for message in stream_parts():  # replies at once, on the same stream
            yield message
        await draining

    p2p = await P2P.create(initial_peers=[boot], host_maddrs=[f"/ip4/{me}/tcp/0"], use_relay=False,
                           tls=os.environ.get("P2P_MESH_TLS", "1") == "1")
    await p2p.add_protobuf_handler(HANDLER, handler, averaging_pb2.AveragingData, stream_input=True,
                                   stream_output=True)
    (out / f"mesh{index}.tmp").write_text(p2p.peer_id.to_base58())
    (out / f"mesh{index}.tmp").rename(out / f"mesh{index}.id")
    deadline = time.monotonic() + 60
    while len(list(out.glob("mesh*.id"))) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    others = [PeerID.from_base58(p.read_text()) for p in sorted(out.glob("mesh*.id"))
              if p.name != f"mesh{index}.id"]
    start_at = float((out / "mesh.start").read_text()) if (out / "mesh.start").exists() else None
    while start_at is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        start_at = float((out / "mesh.start").read_text()) if (out / "mesh.start").exists() else None
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    replies: dict[str, float] = {}

    async def send(peer) -> None:
        async for _ in await p2p.iterate_protobuf_handler(peer, HANDLER, stream_parts(), averaging_pb2.AveragingData):
            pass
        replies[peer.to_base58()] = time.monotonic()

    await asyncio.wait_for(asyncio.gather(*(send(peer) for peer in others)), timeout=600)
    while len(received) < len(others) and time.monotonic() < start_at + 600:
        await asyncio.sleep(0.01)
    await asyncio.sleep(2.0)  # others may still be reading this peer's replies
    await p2p.shutdown()
    return dict(start_at=start_at, last_reply=max(replies.values()), last_received=max(received.values()))


def p2p_mesh(bed, out: Path, boot: str, n: int, nbytes_per_direction: int, part_bytes: int) -> float:
    """Seconds for the mesh (module docstring) on testbed hosts 1..n; the slowest host's last byte."""
    import subprocess

    for old in [*out.glob("mesh*.id"), out / "mesh.start"]:
        old.unlink(missing_ok=True)
    procs = [bed.popen(i, [sys.executable, "-m", "benchmarks.p2p_mesh", bed.ip(i), boot, str(out), str(i), str(n),
                           str(nbytes_per_direction), str(part_bytes)], stdout=subprocess.PIPE, text=True)
             for i in range(1, n + 1)]
    deadline = time.monotonic() + 60
    while len(list(out.glob("mesh*.id"))) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    start_at = time.monotonic() + 2.0
    (out / "mesh.start.tmp").write_text(repr(start_at))
    (out / "mesh.start.tmp").rename(out / "mesh.start")  # atomic: a probe never reads it half written
    results = [json.loads(p.communicate(timeout=700)[0].strip().splitlines()[-1]) for p in procs]
    return max(max(r["last_reply"], r["last_received"]) for r in results) - start_at


def bench_p2p_mesh(group_sizes: tuple[int, ...] = (2, 4), rates: tuple[float, ...] = (20.0, 100.0), runs: int = 3,
                   state_bytes: int = 22_000_000, part_bytes: int = 2**19) -> None:
    """Both meshes (p2p daemons, kernel TCP) on the same testbed, ``runs`` times per rate (module docstring).

    ``state_bytes`` is the all-reduce benchmark's pseudo-gradient (22.0 MB fp32); ``part_bytes`` its part.
    """
    import statistics

    from benchmarks.allreduce_profile import tcp_mesh
    from benchmarks.perf_swarm import _boot, fresh, save
    from benchmarks.testbed import Testbed

    cases = []
    for n, rate in itertools.product(group_sizes, rates):
        bound = 2 * (n - 1) / n * state_bytes * 8 / (rate * 1e6)
        with Testbed(n + 1, rate) as bed:
            out = fresh(f"p2p-mesh-{n}-{int(rate)}")
            boot = _boot(bed, out)
            load = os.getloadavg()[0]
            p2p_s = [p2p_mesh(bed, out, boot, n, state_bytes // n, part_bytes) for _ in range(runs)]
            tcp_s = [tcp_mesh(bed, n, 2 * state_bytes // n) for _ in range(runs)]
        cases.append(dict(peers=n, rate_mbit=rate, bound_s=bound, p2p_s=p2p_s, tcp_s=tcp_s,
                          p2p_ratio=statistics.median(p2p_s) / bound, tcp_ratio=statistics.median(tcp_s) / bound,
                          load_avg_1m_before=load, load_avg_1m_after=os.getloadavg()[0]))
        print(json.dumps(cases[-1]), flush=True)
    save("p2p_mesh", dict(state_bytes=state_bytes, part_bytes=part_bytes, runs=runs, cases=cases))


if __name__ == "__main__":
    me, boot, out, index, n, nbytes, part_bytes = sys.argv[1:8]
    result = asyncio.run(_probe(me, boot, Path(out), int(index), int(n), int(nbytes), int(part_bytes)))
    print(json.dumps(result))
