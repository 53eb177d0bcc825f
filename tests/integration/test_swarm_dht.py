"""DHT start-up errors, identity key handling, signed records and their validation, and interoperability with
hivemind-dht."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import hivemind
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec as ec_keys
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm_helpers.harness import SHARED_MEMORY_KEEPALIVE

from p2p_diloco.swarm import (
    RoundAverager,
    SwarmConfig,
    SwarmStartError,
    ensure_identity,
    fetch_checksums,
    fetch_progress,
    global_epoch,
    install_validators,
    majority_checksum,
    publish_checksum,
    publish_progress,
    signing,
    start_dht,
    visible_maddrs,
)
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION
from p2p_diloco.swarm.records import _MAX_SUBKEYS, ProgressSchema, _fetch_subkeys, checksum_key, progress_key
from p2p_diloco.swarm.signing import (
    RecordAudit,
    RecordGuard,
    load_identity_key,
    own_subkey,
    parse_signed_subkey,
    peer_id_of_public_key,
    record_audit,
    signed_subkey,
)

pytestmark = pytest.mark.timeout(60)
assert SHARED_MEMORY_KEEPALIVE.is_shared()

UNKNOWN_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPWyjpgDrvDMn46Chm4HXcF9StX9GF64BXSL17zVSUBPq"
FP = "abcdef0123456789"
FAKE_IDS = [f"12D3KooWPWyjpgDrvDMn46Chm4HXcF9StX9GF64BXSL17zVSUBP{c}" for c in "ABCDEFGHJK"]


@pytest.fixture
def dht() -> Iterator[hivemind.DHT]:
    node = start_dht(SwarmConfig.for_loopback())
    yield node
    node.shutdown()


def test_bad_multiaddr_is_one_clear_error() -> None:
    cfg = SwarmConfig.for_loopback()
    cfg.initial_peers = ["/ip4/1.2.3.4/tcp/31337"]  # mutated after validation: start_dht checks again
    with pytest.raises(
        SwarmStartError, match=r"initial_peers\[0\].*no /p2p/.*/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW"
    ):
        start_dht(cfg)


def test_unreachable_initial_peer_is_one_clear_error() -> None:
    with pytest.raises(SwarmStartError, match="none of the initial peers responded") as info:
        start_dht(SwarmConfig.for_loopback(initial_peers=[UNKNOWN_PEER]))
    assert UNKNOWN_PEER in str(info.value)


def test_occupied_port_is_one_clear_error(dht: hivemind.DHT) -> None:
    port = visible_maddrs(dht)[0].split("/")[4]
    with pytest.raises(SwarmStartError, match="port is already in use"):
        start_dht(SwarmConfig.for_loopback(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]))
    with socket.socket() as holder:  # a port held by some other program
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        other = holder.getsockname()[1]
        with pytest.raises(SwarmStartError, match="port is already in use"):
            start_dht(SwarmConfig.for_loopback(host_maddrs=[f"/ip4/127.0.0.1/tcp/{other}"]))


def test_identity_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    cfg = SwarmConfig.for_loopback(identity_path=str(path))
    node = start_dht(cfg)
    first_id = node.peer_id.to_base58()
    node.shutdown()
    assert path.stat().st_mode & 0o777 == 0o600
    assert ensure_identity(str(path)) == first_id
    node = start_dht(cfg)
    assert node.peer_id.to_base58() == first_id
    node.shutdown()


def test_readable_identity_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    ensure_identity(str(path))
    path.chmod(0o644)
    # Refused when the configuration is built (a usage error, exit code 2 on the command line).
    with pytest.raises(ValueError, match=rf"chmod 600 {path}"):
        start_dht(SwarmConfig.for_loopback(identity_path=str(path)))
    path.chmod(0o600)
    path.write_bytes(b"not a key")
    with pytest.raises(SwarmStartError, match="not a valid libp2p private key"):
        ensure_identity(str(path))
    with pytest.raises(SwarmStartError, match="does not exist"):
        ensure_identity(str(tmp_path / "missing" / "peer.key"))


async def _plant(_dht: object, node: object, key: str, entries: dict, expiration: float) -> None:
    """Runs in a DHT's process: put entries straight into its storage, as a node without the guard would."""
    for subkey, value in entries.items():
        node.protocol.storage.store_subkey(  # type: ignore[attr-defined]
            DHTID.generate(source=key), subkey, MSGPackSerializer.dumps(value), expiration
        )


def _signed(
    guard_key: RSAPrivateKey, key: str, subkey: object, value: object, expiration: float
) -> DHTRecord:
    record = DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )
    return dataclasses.replace(record, value=RSASignatureValidator(guard_key).sign_value(record))


def test_guard_judges_signature_owner_size_and_schema() -> None:
    run, now = "judged", get_dht_time()
    key, other_key = RSAPrivateKey(), RSAPrivateKey()
    me = peer_id_of_public_key(key.get_public_key().to_bytes())
    other = peer_id_of_public_key(other_key.get_public_key().to_bytes())
    mine, theirs = signed_subkey(me, key), signed_subkey(other, other_key)
    assert parse_signed_subkey(mine) == (me.to_base58(), me.to_base58())
    schema = SchemaValidator(ProgressSchema, prefix=run)
    guard = RecordGuard(key)
    assert guard.merge_with(RecordGuard(schemas=[schema], signed_keys=[progress_key(run)]))
    assert guard.merge_with(RSASignatureValidator(other_key))  # one signature validator per node: ignored
    good = dict(epoch=1, inner_step=2, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0,
                fingerprint="abcdef01", time=now, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)  # fmt: skip
    pk, ck = progress_key(run), checksum_key(run, 1)
    valid = _signed(other_key, pk, theirs, good, now + 60)
    assert guard.judge(valid) is None and guard.judge(_signed(key, ck, mine, "a" * 64, now + 60)) is None
    framed = other.to_base58().encode() + mine[len(me.to_base58()) :]
    cases = {
        "bare peer id": (_signed(key, pk, other.to_base58(), good, now + 60), ("unsigned", None)),
        "no signature": (dataclasses.replace(valid, value=MSGPackSerializer.dumps(good)), ("unsigned", None)),
        "foreign signature": (
            dataclasses.replace(valid, value=_signed(key, pk, mine, good, now + 60).value),
            ("bad_signature", None),
        ),
        "claims another id": (_signed(key, pk, framed, good, now + 60), ("wrong_owner", me.to_base58())),
        "oversized": (
            _signed(other_key, pk, theirs, dict(good, x="y" * 5000), now + 60),
            ("oversized", other),
        ),
        "malformed": (_signed(other_key, pk, theirs, dict(good, epoch=1.0), now + 60), ("malformed", other)),
        "checksum forged": (_signed(key, ck, framed, "a" * 64, now + 60), ("wrong_owner", me.to_base58())),
        "str subkey anywhere": (_signed(key, "any key", "a peer", 1, now + 60), ("unsigned", None)),
    }
    signing._RECEIVED.drain()
    for name, (record, (kind, owner)) in cases.items():
        rejection = guard.judge(record)
        assert rejection is not None and rejection.kind == kind, (name, rejection)
        expected = owner.to_base58() if isinstance(owner, PeerID) else owner
        assert rejection.owner == expected, (name, rejection)
        assert not guard.validate(record) and not guard.validate(record)
    unprotected = DHTRecord(
        DHTID.generate(source="not ours").to_bytes(), MSGPackSerializer.dumps(b"x"), b"1", now
    )
    assert guard.validate(unprotected)  # hivemind's own records: bytes subkeys, no owner key
    counts, owners = signing._RECEIVED.drain()  # each distinct record counted once, however often it was seen
    assert counts == {"unsigned": 3, "bad_signature": 1, "wrong_owner": 2, "malformed": 1, "oversized": 1}
    assert set(owners) == {me.to_base58(), other.to_base58()}
    with pytest.raises(ValueError, match="RSA"):
        ec = ec_keys.generate_private_key(ec_keys.SECP256R1()).private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        load_identity_key(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=ec).SerializeToString())


def test_a_flood_of_subkeys_is_cut_to_the_cap_keeping_signed_ones() -> None:
    key = RSAPrivateKey()
    signed = signed_subkey(peer_id_of_public_key(key.get_public_key().to_bytes()), key)
    flood = {f"junk{i}".encode(): ValueWithExpiration(1, 1e12) for i in range(_MAX_SUBKEYS + 76)}
    flood[signed] = ValueWithExpiration("a" * 64, 1e12)

    class Stub:
        def get(self, key: str, latest: bool, return_future: bool) -> Future:
            found: Future = Future()
            found.set_result(ValueWithExpiration(flood, 1e12))
            return found

    audit = RecordAudit()
    kept = _fetch_subkeys(Stub(), "flooded", audit)  # type: ignore[arg-type]
    assert len(kept) == _MAX_SUBKEYS and signed in kept
    audit.collect(None)
    assert audit.take_report() == ({"oversized": 77}, [])


def test_records_are_signed_and_what_slips_through_is_dropped_counted_and_banned(dht: hivemind.DHT) -> None:
    run = "records"
    install_validators(dht, run)
    relay = start_dht(SwarmConfig.for_loopback(initial_peers=visible_maddrs(dht)))  # no schema for the run
    try:
        me, other = dht.peer_id.to_base58(), relay.peer_id.to_base58()
        assert parse_signed_subkey(own_subkey(relay)) == (other, other)  # made without identity_path
        rates = dict(inner_step=7, steps_per_s=2.5, samples_per_s=10.0, tokens_per_s=5e3, fingerprint=FP)
        assert publish_progress(dht, run, epoch=3, **rates)
        assert publish_progress(relay, run, epoch=50, ttl_s=6.0, **rates)
        now = get_dht_time()
        good = dict(rates, epoch=9, inner_step=1, time=now, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
        # What a node without the run's schema keeps and passes on: records under bare peer ids, unsigned.
        junk = {
            FAKE_IDS[0]: good,
            FAKE_IDS[1]: dict(good, epoch=9.0),
            me: "not a dict",
            "not a peer id": good,
        }
        relay.run_coroutine(
            functools.partial(_plant, key=progress_key(run), entries=junk, expiration=now + 60)
        )
        for reader in (dht, relay):
            records = fetch_progress(reader, run)
            assert {r.peer_id for r in records} == {me, other}
            mine = [r for r in records if r.peer_id == me]
            assert len(mine) == 1 and mine[0].epoch == 3 and mine[0].steps_per_s == 2.5
        assert global_epoch(records) == 50
        assert record_audit(relay).take_report() == ({"unsigned": 4}, [])  # read back by its own reader
        # dht refused the relay's answer, which carried the junk (hivemind drops such a dictionary whole)
        counts, bans = record_audit(dht).take_report()
        assert counts.get("unsigned", 0) >= 1 and bans == []
        deadline = time.monotonic() + 20
        while other in {r.peer_id for r in records} and time.monotonic() < deadline:
            time.sleep(0.2)
            records = fetch_progress(dht, run)
        assert {r.peer_id for r in records} == {me} and global_epoch(records) == 3

        sha_a, sha_b = "a" * 64, "b" * 64
        assert publish_checksum(dht, run, 3, sha_a)
        assert publish_checksum(relay, run, 3, sha_a)
        junk = {me: sha_b, FAKE_IDS[0]: sha_b, FAKE_IDS[1]: sha_b, FAKE_IDS[2]: 12345}  # forged majority
        relay.run_coroutine(
            functools.partial(_plant, key=checksum_key(run, 3), entries=junk, expiration=now + 60)
        )
        for reader in (dht, relay):
            assert fetch_checksums(reader, run, 3) == {me: sha_a, other: sha_a}
            assert majority_checksum(reader, run, 3) == (sha_a, 2, 2)
        assert majority_checksum(dht, run, 4) == (None, 0, 0)
        assert record_audit(relay).take_report() == ({"unsigned": 4}, [])
        counts, bans = record_audit(dht).take_report()  # dht refused the relay's answers (str subkeys)
        assert set(counts) == {"unsigned"} and bans == []
        with pytest.raises(ValueError, match="64 lowercase hex"):
            publish_checksum(dht, run, 3, "A" * 64)

        # (Expirations differ from the planted ones: hivemind's storage orders equal expirations by subkey,
        # and a str and a bytes subkey cannot be compared.)
        # The relay signs junk: a checksum no schema can refuse on receipt, dropped on reading, so the relay
        # is banned; then its other records are skipped, and its malformed progress is refused on receipt.
        assert relay.store(
            checksum_key(run, 5), subkey=own_subkey(relay), value="zz", expiration_time=now + 90
        )
        assert fetch_checksums(dht, run, 5) == {}
        counts, bans = record_audit(dht).take_report()
        assert counts == {"malformed": 1} and len(bans) == 1 and bans[0].startswith(f"{other}: signed")
        assert record_audit(dht).take_bans() == {other: bans[0].split(": ", 1)[1]}
        assert fetch_checksums(dht, run, 3) == {me: sha_a}
        relay.store(
            progress_key(run), subkey=own_subkey(relay), value=dict(good, epoch="9"), expiration_time=now + 90
        )
        assert {r.peer_id for r in fetch_progress(dht, run)} == {me}
        assert record_audit(dht).take_report() == ({"malformed": 1}, [])
        assert fetch_checksums(relay, run, 5) == {}
        assert record_audit(relay).take_report() == ({"malformed": 1}, [])  # never bans itself
    finally:
        relay.shutdown()


@pytest.mark.slow
def test_plain_hivemind_dht_node_interoperates(tmp_path: Path) -> None:
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        pytest.skip("needs unshare and ip to give the stock CLI a private network namespace")
    probe = subprocess.run([unshare, "-n", ip, "link", "set", "lo", "up"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.decode(errors='replace')[:200]}")
    out = tmp_path / "interop.json"
    helper = Path(__file__).parents[1] / "swarm_helpers" / "interop.py"
    script = f'"{ip}" link set lo up && exec "{sys.executable}" "{helper}" "{out}"'
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    run = subprocess.run([unshare, "-n", "sh", "-c", script], capture_output=True, timeout=50, env=env)
    assert out.exists(), run.stdout.decode(errors="replace")[-3000:]
    report = json.loads(out.read_text())
    assert report["cli_started"] and report["cli_alive"], report["cli_log_tail"]
    assert report["value_via_cli_node"] == "hello", report["cli_log_tail"]


def test_averager_rejects_bad_inputs_and_skips_when_alone(dht: hivemind.DHT) -> None:
    cfg = SwarmConfig.for_loopback(
        run_id="alone", matchmaking_time_s=1.0, matchmaking_timeout_s=2.0, request_timeout_s=0.5
    )
    averager = RoundAverager([torch.zeros(2, 3), torch.zeros(4)], dht, cfg, fingerprint="abcdef0123456789")
    try:
        good = [torch.ones(2, 3), torch.ones(4)]
        with pytest.raises(ValueError, match=r"fresh\[1\] is \(5,\)"):
            averager.average([torch.ones(2, 3), torch.ones(5)], weight=1.0, staleness=0, epoch=0)
        with pytest.raises(ValueError, match="NaN"):
            averager.average(
                [torch.ones(2, 3), torch.full((4,), float("nan"))], weight=1.0, staleness=0, epoch=0
            )
        with pytest.raises(ValueError, match="weight"):
            averager.average(good, weight=float("inf"), staleness=0, epoch=0)
        result = averager.average(good, weight=1.0, staleness=0, epoch=0)
        assert result.outcome == "skipped" and "no group" in result.reason
        assert result.fresh_mean is None and result.group_size == 0
    finally:
        averager.shutdown()
