"""A hostile DHT writer: a plain hivemind DHT node that keeps sending junk records of one run to every node.

Usage: python tests/swarm_helpers/dht_vandal.py MADDR RUN_ID IDENTITY_PATH OUT.json

It joins through ``MADDR`` with its own RSA identity (hivemind's ``RSASignatureValidator``, the key it signs
with) and, every ``PERIOD_S`` seconds until SIGTERM, sends raw store requests to every node it knows and keeps the
records with bytes subkeys in its own storage (so they also come back in the answers to lookups):

- ``malformed``: a progress record under its own signed subkey, correctly signed, with a string epoch;
- ``oversized``: the same with a value far over ``signing.MAX_VALUE_BYTES``;
- ``forged_plain``: an unsigned progress record under an honest peer's bare peer id (the old format);
- ``forged_unsigned``: an honest peer's exact signed subkey, with no signature;
- ``bad_signature``: an honest peer's signed subkey, signed with the vandal's key;
- ``wrong_owner``: an honest peer's id with the vandal's public key, correctly signed by the vandal;
- ``checksum_unsigned`` / ``checksum_signed``: a wrong digest under honest bare ids (str subkeys), and junk
  under its own signed subkey with the same expiration, at the checksum keys of the first epochs: stored
  together, a str and a bytes subkey of equal expiration would break hivemind's storage of the key.

Forged progress records claim epoch 10**6: a peer that believed one would think itself far behind. OUT.json
gets ``{"peer_id": ...}`` once the node is up, then per kind how many records were sent and how many a node
accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import signal
import sys
import threading
import time
from collections import Counter
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

FORGED_EPOCH = 10**6
CHECKSUM_EPOCHS = 5
PERIOD_S = 1.5
PROGRESS_KINDS = ("malformed", "oversized", "forged_plain", "forged_unsigned", "bad_signature", "wrong_owner")


def _sign(key: Any, raw_key: str, subkey: Any, value: bytes, expiration: float) -> bytes:
    record = DHTRecord(
        DHTID.generate(source=raw_key).to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration
    )
    signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)


def _records(key: Any, me: PeerID, run: str, honest: dict[str, bytes], template: dict) -> list[tuple]:
    """(kind, raw key, subkey, value bytes, expiration) for one round of vandalism."""
    exp = get_dht_time() + 30
    mine = signed_subkey(me, key)
    public = mine[len(me.to_base58()) :]
    pk = progress_key(run)
    lie = MSGPackSerializer.dumps(dict(template, epoch=FORGED_EPOCH, time=get_dht_time()))
    out = [
        (
            "malformed",
            pk,
            mine,
            _sign(key, pk, mine, MSGPackSerializer.dumps(dict(template, epoch="9")), exp),
        ),
        (
            "oversized",
            pk,
            mine,
            _sign(key, pk, mine, MSGPackSerializer.dumps(dict(template, pad="x" * 20_000)), exp),
        ),
        (  # a record of another protocol version under our key: dropped unread, never a reason to ban
            "version",
            pk,
            mine,
            _sign(key, pk, mine, MSGPackSerializer.dumps(dict(template, protocol=PROTOCOL_VERSION + 1)), exp),
        ),
    ]
    for peer, subkey in honest.items():
        framed = peer.encode() + public
        out += [
            ("forged_plain", pk, peer, lie),
            ("forged_unsigned", pk, subkey, lie),
            ("bad_signature", pk, subkey, _sign(key, pk, mine, lie, exp)),  # signed over another subkey
            ("wrong_owner", pk, framed, _sign(key, pk, framed, lie, exp)),
        ]
        for epoch in range(CHECKSUM_EPOCHS):
            ck = checksum_key(run, epoch)
            out.append(("checksum_unsigned", ck, peer, MSGPackSerializer.dumps("f" * 64)))
    for epoch in range(CHECKSUM_EPOCHS):
        ck = checksum_key(run, epoch)
        out.append(("checksum_signed", ck, mine, _sign(key, ck, mine, MSGPackSerializer.dumps("junk"), exp)))
    return [(*r, exp) for r in out]


async def _blast(
    _dht: Any, node: Any, identity_path: str, run: str, honest: dict[str, bytes], template: dict
) -> list[tuple[str, int, int]]:
    """Make one round of records, store them locally and send them to every known node; returns (kind,
    sent, accepted) per record. Runs in the DHT's process: hivemind's control pipe cannot carry the
    oversized records themselves."""
    key = load_identity_key(Path(identity_path).read_bytes())
    peers = list(node.protocol.routing_table.peer_id_to_uid)
    results = []
    for kind, raw_key, subkey, value, exp in _records(key, node.peer_id, run, honest, template):
        key_id = DHTID.generate(source=raw_key)
        if isinstance(
            subkey, bytes
        ):  # mixed subkey types would break its own storage (see signing.RecordGuard)
            node.protocol.storage.store_subkey(key_id, subkey, value, exp)
        answers = await asyncio.gather(
            *(node.protocol.call_store(peer, [key_id], [value], exp, subkeys=[subkey]) for peer in peers)
        )
        results.append((kind, len(peers), sum(bool(a and a[0]) for a in answers)))
    return results


def main() -> None:
    maddr, run, identity_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    ensure_identity(identity_path)
    key = load_identity_key(Path(identity_path).read_bytes())
    dht = hivemind.DHT(
        initial_peers=[maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=identity_path,
        check_if_identity_free=False,
        use_relay=False,
        use_auto_relay=False,
        nat_port_map=False,
        record_validators=[RSASignatureValidator(key)],
        start=True,
    )
    me = dht.peer_id
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    report: dict[str, Any] = {"peer_id": me.to_base58()}
    write_report(out_path, report)
    sent, accepted = Counter(), Counter()
    honest: dict[str, bytes] = {}
    template = dict(
        epoch=0,
        inner_step=0,
        steps_per_s=1.0,
        samples_per_s=4.0,
        tokens_per_s=256.0,
        fingerprint="abcdef01",
        time=0.0,
        client_mode=False,
    )
    deadline = time.monotonic() + 600
    while not stop.is_set() and time.monotonic() < deadline:
        found = dht.get(progress_key(run), latest=True)
        for subkey, entry in (found.value if found is not None else {}).items():
            parsed = parse_signed_subkey(subkey)
            if isinstance(parsed, tuple) and parsed[0] == parsed[1] != me.to_base58():
                honest[parsed[0]] = subkey
                if isinstance(entry.value, dict) and isinstance(entry.value.get("fingerprint"), str):
                    template["fingerprint"] = entry.value["fingerprint"]  # as convincing as possible
        blast = functools.partial(
            _blast, identity_path=identity_path, run=run, honest=honest, template=template
        )
        for kind, n_sent, n_accepted in dht.run_coroutine(blast):
            sent[kind] += n_sent
            accepted[kind] += n_accepted
        report.update(sent=dict(sent), accepted=dict(accepted), honest=sorted(honest))
        write_report(out_path, report)
        stop.wait(PERIOD_S)
    dht.shutdown()



if __name__ == "__main__":
    main()
