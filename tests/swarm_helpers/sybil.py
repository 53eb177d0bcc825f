"""A Sybil attacker: one plain hivemind DHT node speaking for K free identities, every record correctly signed.

Usage: python tests/swarm_helpers/sybil.py MADDR RUN_ID WORKDIR OUT.json K

It makes K identity keys (one per Sybil: what a fresh peer id costs) and, every ``PERIOD_S`` seconds until
SIGTERM, stores for each of them, signed with that Sybil's own key under its own signed subkey (so every
node's guard accepts them: nothing about them is malformed):

- a progress record of the run's model (fingerprint read from the honest records) claiming epoch
  ``INFLATED_EPOCH``: one such record used to make every honest peer resync to it, or stall when nobody
  served that epoch;
- a checksum vote of ``SYBIL_DIGEST`` for each epoch near the honest peers' (``max - 1`` to ``max + 3``):
  K > n such votes used to make honest peers believe they drifted.

It serves no state. OUT.json gets ``{"sybils": [...], "node": ...}`` once up, then how many records were sent
and how many nodes accepted, the honest epochs it saw and the fingerprint its last records claimed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from reports import write_report  # sibling module: these scripts run as files

from p2p_diloco.swarm.dht import ensure_identity
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION
from p2p_diloco.swarm.records import checksum_key, progress_key
from p2p_diloco.swarm.signing import load_identity_key, parse_signed_subkey, signed_subkey

INFLATED_EPOCH = 10**6
SYBIL_DIGEST = hashlib.sha256(b"sybil").hexdigest()
PERIOD_S = 2.0


def _sign(key: Any, raw_key: str, subkey: bytes, value: bytes, expiration: float) -> bytes:
    record = DHTRecord(DHTID.generate(source=raw_key).to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration)
    signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)


@functools.lru_cache(maxsize=1)
def _keys(paths: tuple[str, ...]) -> list[tuple[Any, bytes]]:
    """(key, signed subkey) of each Sybil, loaded in the DHT's process (keys do not travel its pipe)."""
    out = []
    for path in paths:
        data = Path(path).read_bytes()
        key = load_identity_key(data)
        out.append((key, signed_subkey(PeerID.from_identity(data), key)))
    return out


async def _blast(_dht: Any, node: Any, paths: tuple[str, ...], run: str, fingerprint: str,
                 honest_epoch: int) -> tuple[int, int]:
    """Store every Sybil's records locally and at every known node; returns (sent, accepted). Runs in the
    DHT's process."""
    sybils = _keys(paths)
    exp = get_dht_time() + 30
    record = dict(epoch=INFLATED_EPOCH, inner_step=10**7, steps_per_s=1.0, samples_per_s=4.0, tokens_per_s=256.0,
                  fingerprint=fingerprint, time=get_dht_time(), client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
    peers = list(node.protocol.routing_table.peer_id_to_uid)
    sent = accepted = 0
    for key, subkey in sybils:
        items = [(progress_key(run), MSGPackSerializer.dumps(record))]
        items += [(checksum_key(run, e), MSGPackSerializer.dumps(SYBIL_DIGEST))
                  for e in range(max(0, honest_epoch - 1), honest_epoch + 4)]
        for raw_key, value in items:
            signed = _sign(key, raw_key, subkey, value, exp)
            key_id = DHTID.generate(source=raw_key)
            node.protocol.storage.store_subkey(key_id, subkey, signed, exp)
            answers = await asyncio.gather(
                *(node.protocol.call_store(peer, [key_id], [signed], exp, subkeys=[subkey]) for peer in peers))
            sent += len(peers)
            accepted += sum(bool(a and a[0]) for a in answers)
    return sent, accepted


def main() -> None:
    maddr, run, workdir, out_path, k = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    workdir.mkdir(parents=True, exist_ok=True)
    paths = tuple(str(workdir / f"sybil{i}.id") for i in range(k))
    ids = [ensure_identity(path) for path in paths]
    node_path = str(workdir / "node.id")
    ensure_identity(node_path)
    dht = hivemind.DHT(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=node_path,
                       check_if_identity_free=False, use_relay=False, use_auto_relay=False, nat_port_map=False,
                       record_validators=[RSASignatureValidator(load_identity_key(Path(node_path).read_bytes()))],
                       start=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    report: dict[str, Any] = {"sybils": ids, "node": dht.peer_id.to_base58(), "sent": 0, "accepted": 0,
                              "honest_epochs": []}
    write_report(out_path, report)
    fingerprint, honest_epoch = "abcdef01", 0
    deadline = time.monotonic() + 600
    while not stop.is_set() and time.monotonic() < deadline:
        blast = functools.partial(_blast, paths=paths, run=run, fingerprint=fingerprint, honest_epoch=honest_epoch)
        sent, accepted = dht.run_coroutine(blast)
        report["sent"] += sent
        report["accepted"] += accepted
        report["honest_epochs"].append(honest_epoch)
        report["fingerprint"] = fingerprint  # the model the records just sent claim
        write_report(out_path, report)
        stop.wait(PERIOD_S)
        found = dht.get(progress_key(run), latest=True)  # after the first blast: a lookup of nothing is slow
        for subkey, entry in (found.value if found is not None else {}).items():
            parsed = parse_signed_subkey(subkey)
            value = entry.value
            if isinstance(parsed, tuple) and parsed[0] not in ids and isinstance(value, dict):
                if isinstance(value.get("fingerprint"), str):
                    fingerprint = value["fingerprint"]  # as convincing as possible
                if isinstance(value.get("epoch"), int) and value["epoch"] < INFLATED_EPOCH:
                    honest_epoch = max(honest_epoch, value["epoch"])
    dht.shutdown()



if __name__ == "__main__":
    main()
