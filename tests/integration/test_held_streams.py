"""One identity can no longer hold a donor's streams open: a real averager closes each one it cannot use.

A donor (``RoundAverager`` in its own process, serving a tiny state through ``StateServer``) listens on
loopback; an attacker (a bare hivemind ``P2P`` node, as any peer has) opens streams to each of its one-request
RPCs and holds them the two ways ``benchmarks/held_streams.py`` measured under hivemind's own wrapper (3000
held streams, one file descriptor each, every one open until the attacker let go):

- a valid request without its end-of-stream marker;
- a message marker and a 2^40-byte length prefix, then nothing.

The all-reduce's ``rpc_aggregate_part`` streams both ways; hivemind awaited its first part without a limit, so
it is held the same two ways, and by a stream that sends nothing at all.

Each stream must be closed by the donor (the attacker reads the end of it) while the attacker keeps its end
open, and an honest caller must still get the manifest through hivemind's own stub. Undo the registration in
``RoundAverager.add_p2p_handlers`` (``access.serve_bounded``) and no held stream ends: the test fails at its bounded wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm import RoundAverager, StateServer, SwarmConfig, start_dht, visible_maddrs
from p2p_diloco.swarm.bounded_rpc import BOUNDED_RPCS
from p2p_diloco.swarm.chunk_transfer import MANIFEST, encode_request
from p2p_diloco.swarm.dht import ensure_identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FINGERPRINT = "abcdef0123456789"
PER_WAY = 8
"""Streams held per RPC and way: enough to see that none survives, few enough for any open-files limit."""
# The empty answer allowed below: one CI run (before this file printed the donor's log) saw one after the attack,
# and its cause is not found. An honest caller gets an empty answer only where the donor closes its stream without
# a message: a request not complete within request_timeout_s or over MAX_WAITING_PER_PEER (bounded_rpc: "Closed a
# ... stream from <caller>"), the gate's refusal ("Refused a state chunk to <caller>"), no state or no manifest to
# serve (chunk_transfer: "No state to serve", "No manifest for digest"), each logged by the donor at DEBUG or
# above; a libp2p reset of the stream reads as an empty answer too, and is logged by none. 220 requests after 22
# attacks (idle, and with two and three busy loops on the two cores) got no empty answer, and the honest requests
# were read within 23 ms of their 1 s bound. A second empty answer fails the test and prints the donor's log.
MANIFEST_TRIES = 2
"""Manifest requests the honest caller makes after the attack: at most one may get an empty answer. A joiner that
gets one asks its other donors and again at its next catch-up, so one is not a denial of service. Each try is
bounded by 30 s."""
CLOSE_WAIT_S = 60.0
"""Bound on the wait for the donor to close them all: its limits are ``request_timeout_s`` (1 s on loopback) and,
for the all-reduce, ``next_chunk_timeout_s`` (5 s)."""


@pytest.fixture
def donor_log(tmp_path: Path) -> Iterator[Path]:
    """The donor's log (ours at DEBUG, hivemind's at INFO), written by its averager process too (the handler is
    there before the fork): a failure names what the donor did with each stream."""
    path = tmp_path / "donor.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    loggers = {logging.getLogger("p2p_diloco"): logging.DEBUG, logging.getLogger("hivemind"): logging.INFO}
    levels = [lg.level for lg in loggers]
    for lg, level in loggers.items():
        lg.addHandler(handler)
        lg.setLevel(level)
    try:
        yield path
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


@pytest.fixture
def donor(tmp_path: Path, donor_log: Path) -> Iterator[RoundAverager]:
    key = str(tmp_path / "donor.key")
    ensure_identity(key)
    cfg = SwarmConfig.for_loopback(run_id="held", identity_path=key)
    dht = start_dht(cfg)
    averager = RoundAverager([torch.zeros(8)], dht, cfg, fingerprint=FINGERPRINT)
    StateServer(averager).publish([torch.ones(8)], [torch.zeros(8)], epoch=3)
    try:
        yield averager
    finally:
        averager.shutdown()
        dht.shutdown()


def _request(rpc: str) -> bytes:
    if rpc == "rpc_join_group":
        return averaging_pb2.JoinRequest(schema_hash=b"x", expiration=0).SerializeToString()
    if rpc == "rpc_download_state":
        return averaging_pb2.DownloadRequest().SerializeToString()
    return averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST)).SerializeToString()


async def _hold(attacker: P2P, target: PeerID, name: str, rpc: str, way: str) -> tuple[Any, Any]:
    _, reader, writer = await attacker.call_binary_stream_handler(target, name)
    if way == "silent":
        return reader, writer
    try:
        writer.write(P2P.MESSAGE_MARKER)
        if way == "no-eos" and rpc == "rpc_aggregate_part":  # the start of a first part, never finished
            writer.write((64).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x00" * 10)
            await writer.drain()
        elif way == "no-eos":
            await P2P.send_raw_data(_request(rpc), writer)
        else:
            writer.write((1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            await writer.drain()
    except ConnectionError:
        pass  # the donor closed it already (more than MAX_WAITING_PER_PEER of ours were waiting): as wanted
    return reader, writer


async def _ended(reader: Any) -> bool:
    """True once the donor ended the stream (end of stream or a reset), reading whatever it sent first."""
    try:
        while await reader.read(1 << 16):
            pass
    except ConnectionError:
        pass
    return True


async def _manifest(client: P2P, target: PeerID, prefix: str) -> dict | None:
    """The donor's manifest, as a joiner asks for it; ``None`` for an empty answer."""
    stub = RoundAverager.get_stub(client, target, namespace=prefix)
    request = averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST))
    async for message in await stub.rpc_state_chunk(request):
        return MSGPackSerializer.loads(message.metadata)
    return None


async def _attack(averager: RoundAverager) -> dict[str, Any]:
    maddrs = visible_maddrs(averager.dht)
    target = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
    attacker = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    held: list[tuple[str, Any, Any]] = []
    try:
        part = f"{averager.prefix}::RoundAverager.rpc_aggregate_part"
        for way in ("no-eos", "prefix", "silent"):
            for _ in range(PER_WAY):
                reader, writer = await _hold(attacker, target, part, "rpc_aggregate_part", way)
                held.append((f"rpc_aggregate_part/{way}", reader, writer))
        for rpc in BOUNDED_RPCS:
            name = f"{averager.prefix}::RoundAverager.{rpc}"
            for way in ("no-eos", "prefix"):
                for _ in range(PER_WAY):
                    reader, writer = await _hold(attacker, target, name, rpc, way)
                    held.append((f"{rpc}/{way}", reader, writer))
        during = await asyncio.wait_for(_manifest(client, target, averager.prefix), 30)
        ends = {asyncio.create_task(_ended(reader)): label for label, reader, _ in held}
        _, pending = await asyncio.wait(ends, timeout=CLOSE_WAIT_S)
        for task in pending:
            task.cancel()
        after, empty = None, 0
        for _ in range(MANIFEST_TRIES):
            after = await asyncio.wait_for(_manifest(client, target, averager.prefix), 30)
            if after is not None:
                break
            empty += 1
        return dict(during=during, after=after, empty=empty, still_open=sorted(ends[task] for task in pending))
    finally:
        for _, _, writer in held:
            writer.close()
        await attacker.shutdown()
        await client.shutdown()


def test_a_donor_closes_every_stream_held_without_a_complete_request(donor: RoundAverager, donor_log: Path
                                                                     ) -> None:
    result = asyncio.run(_attack(donor))
    log = [line for line in donor_log.read_text(errors="replace").splitlines()
           if line.strip() and "p2p_daemon" not in line and not line.startswith("\t")]  # the p2pd's own noise
    assert result["still_open"] == [], (
        f"streams still open after {CLOSE_WAIT_S} s: {result['still_open']}")
    assert result["during"] is not None and result["during"]["ep"] == 3, (
        "the donor answered no manifest during the attack; its log ends:\n" + "\n".join(log[-40:]))
    assert result["after"] is not None and result["after"]["ep"] == 3, (
        f"{result['empty']} manifest requests after the attack got an empty answer; the donor's log ends:\n"
        + "\n".join(log[-40:]))
    assert donor.is_alive()
