"""A leech: one free identity that downloads every donor's state without end, to hold their rounds open.

Usage: python tests/swarm_helpers/leech.py MADDR RUN_ID WORKDIR OUT.json

Built from the project's own parts: a hivemind DHT node with one identity, the averager's RPC stub and the
chunk request format of ``swarm.chunk_transfer``. It reads the run's model fingerprint from the honest
progress records, finds the donors under the averager's ``all_averagers`` key, and then runs ``LOOPS``
request loops per donor (within the per-peer stream cap), each asking for the donor's manifest and then for
random chunks of the state it names, one every ``PAUSE_S`` at most: a chunk served less than 2 s ago is what
made a donor count a download in flight, so this kept every donor waiting its whole download limit each
round, for the price of a few MiB/s. It checks nothing and keeps nothing.

OUT.json gets ``{"peer_id": ...}`` once up, then the chunks received (``chunks``), the wall time of the
first (``first_chunk``) and the donors it leeches (``donors``), rewritten every second until SIGTERM.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from reports import write_report  # sibling module: these scripts run as files

from p2p_diloco.core.chunks import DIGEST_BYTES
from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.chunk_transfer import MANIFEST, encode_request
from p2p_diloco.swarm.dht import ensure_identity
from p2p_diloco.swarm.protocol import averager_prefix
from p2p_diloco.swarm.records import fetch_progress
from p2p_diloco.swarm.signing import load_identity_key

LOOPS = 4
PAUSE_S = 1.0


async def _answer(stub: Any, sha: str | None, index: int) -> tuple[bytes, int]:
    """(metadata, bytes of chunk data) of one request; empty when refused."""
    stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=encode_request(sha, index)))
    metadata, size = b"", 0
    async for message in stream:
        metadata = metadata or bytes(message.metadata)
        size += len(message.tensor_part.buffer)
    return metadata, size


async def _leech(p2p: Any, prefix: str, donor: str, report: dict, stop: asyncio.Event) -> None:
    stub = RoundAverager.get_stub(p2p, PeerID.from_base58(donor), namespace=prefix)
    sha, count = None, 0
    while not stop.is_set():
        try:
            if sha is None:
                raw, _ = await asyncio.wait_for(_answer(stub, None, MANIFEST), 10)
                meta = MSGPackSerializer.loads(raw) if raw else None
                if isinstance(meta, dict):
                    sha, count = meta["sha"], (len(meta["pc"]) + len(meta["mc"])) // DIGEST_BYTES
            else:
                _, size = await asyncio.wait_for(_answer(stub, sha, random.randrange(count)), 10)
                if size:
                    report["chunks"] += 1
                    report["first_chunk"] = report["first_chunk"] or time.time()
                else:
                    sha = None  # the donor moved on to another state: ask for its new manifest
        except Exception:  # noqa: BLE001 - a cut stream: ask again
            sha = None
        await asyncio.sleep(PAUSE_S * random.random())


def main() -> None:
    maddr, run, workdir, out_path = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    workdir.mkdir(parents=True, exist_ok=True)
    identity = str(workdir / "leech.id")
    peer_id = ensure_identity(identity)
    dht = hivemind.DHT(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=identity,
                       check_if_identity_free=False, use_relay=False, use_auto_relay=False, nat_port_map=False,
                       record_validators=[RSASignatureValidator(load_identity_key(Path(identity).read_bytes()))],
                       start=True)
    report: dict[str, Any] = {"peer_id": peer_id, "chunks": 0, "first_chunk": None, "donors": []}
    write_report(out_path, report)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    deadline = time.monotonic() + 600
    prefix, donors = None, []
    while not stopping and time.monotonic() < deadline and not donors:  # the model and its donors
        records = fetch_progress(dht, run)
        if records:
            prefix = averager_prefix(run, records[0].fingerprint)
            found = dht.get(f"{prefix}.all_averagers", latest=True)
            if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict):
                donors = [PeerID(k).to_base58() for k, v in found.value.items() if v.value is not None]
        time.sleep(0.5)
    report["donors"] = donors
    write_report(out_path, report)

    async def run_all() -> None:
        p2p = await dht.replicate_p2p()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_leech(p2p, prefix, d, report, stop)) for d in donors for _ in range(LOOPS)]
        while not stopping and time.monotonic() < deadline:
            write_report(out_path, report)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    if donors:
        asyncio.run(run_all())
    write_report(out_path, report)
    dht.shutdown()



if __name__ == "__main__":
    main()
