"""A slot holder: free identities that ask every donor for state chunks and never read the answers.

Usage: python tests/swarm_helpers/slot_holder.py BOOTSTRAP RUN_ID OUT.json IDENTITIES STREAMS HOLD_S DONOR_MADDR...

Built from the project's own parts: a hivemind DHT node to read the run's model fingerprint from the honest
progress records (the averager's namespace), one bare hivemind ``P2P`` per identity (each a fresh key, as any
peer makes), the averager's RPC stub for manifests and the chunk request format of ``swarm.chunk_transfer``.
Each identity runs ``STREAMS`` loops per donor (the per-peer cap, ``access.MAX_CHUNK_STREAMS_PER_PEER``): ask
the donor's manifest (read: a few hundred bytes), open a ``rpc_state_chunk`` stream for a random full-size
chunk of the state it names, send the request and its end-of-stream marker, read nothing for ``HOLD_S`` (its side of the
stream paused: with this process's own buffer of about 200 KiB a 1 MiB chunk fit in the buffers on loopback
and held nothing), then close.
4 identities x 4 streams are every donor's 16 slots. It cannot see a donor cut a held stream (it reads
nothing), so it asks again only every ``HOLD_S``: a faster cycle only frees slots sooner.

OUT.json gets the streams opened and held now (``opened``, ``holding``), the manifest bytes read (``read``: the
only bytes it reads) and the wall time the attack began (``began``),
rewritten every second until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from reports import write_report  # sibling module: these scripts run as files

from p2p_diloco.core.chunks import DIGEST_BYTES
from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.chunk_transfer import MANIFEST, encode_request
from p2p_diloco.swarm.dht import ensure_identity
from p2p_diloco.swarm.protocol import averager_prefix
from p2p_diloco.swarm.records import fetch_progress
from p2p_diloco.swarm.signing import load_identity_key

DEADLINE_S = 600.0
"""The script ends on its own after this long, whatever the test does."""


async def _manifest(stub: Any) -> tuple[str, list[int], int] | None:
    """(digest, indices of its full 1 MiB chunks, bytes read) of the donor's served state, or None when it
    answered nothing. Each region's last chunk is short, and an answer that fits in the buffers holds nothing."""
    stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST)))
    raw = b"".join([bytes(m.metadata) async for m in stream])
    meta = MSGPackSerializer.loads(raw) if raw else None
    if not isinstance(meta, dict):
        return None
    params, momentum = len(meta["pc"]) // DIGEST_BYTES, len(meta["mc"]) // DIGEST_BYTES
    full = [*range(params - 1), *range(params, params + momentum - 1)]
    return meta["sha"], full or [0], len(raw)


async def _hold(p2p: P2P, donor: PeerID, prefix: str, hold_s: float, report: dict, stop: asyncio.Event) -> None:
    stub = RoundAverager.get_stub(p2p, donor, namespace=prefix)
    name = f"{prefix}::RoundAverager.rpc_state_chunk"
    while not stop.is_set():
        try:
            found = await asyncio.wait_for(_manifest(stub), 10)
            if found is None:
                await asyncio.sleep(0.5 * random.random())
                continue
            sha, full, size = found
            report["read"] += size
            _, _, writer = await p2p.call_binary_stream_handler(donor, name)
        except Exception:  # noqa: BLE001 - refused or cut: ask again
            await asyncio.sleep(0.5 * random.random())
            continue
        report["opened"] += 1
        report["holding"] += 1
        try:
            request = averaging_pb2.DownloadData(metadata=encode_request(sha, random.choice(full)))
            await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            writer.transport.pause_reading()  # not even this process takes the answer off its daemon
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), hold_s)
        except Exception:  # noqa: BLE001 - the donor closed it: ask again
            pass
        finally:
            report["holding"] -= 1
            writer.close()


def main() -> None:
    bootstrap, run, out_path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    identities, streams, hold_s = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    donor_maddrs = sys.argv[7:]
    identity = str(out_path.with_suffix(".id"))  # the DHT node's, to read the signed progress records
    ensure_identity(identity)
    dht = hivemind.DHT(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=identity,
                       check_if_identity_free=False, use_relay=False, use_auto_relay=False, nat_port_map=False,
                       record_validators=[RSASignatureValidator(load_identity_key(Path(identity).read_bytes()))],
                       start=True)
    report: dict[str, Any] = {"opened": 0, "holding": 0, "read": 0, "began": None}
    write_report(out_path, report)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    deadline = time.monotonic() + DEADLINE_S
    prefix = None
    while not stopping and time.monotonic() < deadline and prefix is None:
        try:
            records = fetch_progress(dht, run)
        except Exception:  # noqa: BLE001 - a DHT read timed out (a loaded machine): read again
            records = []
        if records:
            prefix = averager_prefix(run, records[0].fingerprint)
        else:
            time.sleep(0.5)
    donors = [PeerID.from_base58(m.rsplit("/p2p/", 1)[1]) for m in donor_maddrs]

    async def run_all() -> None:
        nodes = [await P2P.create(initial_peers=donor_maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                 for _ in range(identities)]
        stop = asyncio.Event()
        report["began"] = time.time()
        tasks = [asyncio.create_task(_hold(node, donor, prefix, hold_s, report, stop))
                 for node in nodes for donor in donors for _ in range(streams)]
        while not stopping and time.monotonic() < deadline:
            write_report(out_path, report)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in nodes:
            await node.shutdown()

    if prefix is not None:
        asyncio.run(run_all())
    write_report(out_path, report)
    dht.shutdown()


if __name__ == "__main__":
    main()
