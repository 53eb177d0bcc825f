"""Peers of another release (``swarm.protocol``): they meet under other names, and a record of another version
that reaches us anyway is dropped unread with no one banned."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.swarm.protocol import PROTOCOL_VERSION, averager_prefix, neighbours, versioned
from p2p_diloco.swarm.records import PeerProgress, ProgressSchema, _parse_progress, checksum_key, progress_key
from p2p_diloco.swarm.signing import RecordGuard, peer_id_of_public_key, signed_subkey

KEY = RSAPrivateKey()
PEER = peer_id_of_public_key(KEY.get_public_key().to_bytes())
SIGNED = signed_subkey(PEER, KEY)
GOOD = dict(epoch=1, inner_step=2, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0, fingerprint="abcdef01",
            time=1.0, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)


def test_every_name_peers_meet_under_carries_the_version_and_version_one_kept_the_bare_names() -> None:
    assert progress_key("run", 1) == "run_progress" and checksum_key("run", 3, 1) == "run_checksum_e3"
    assert averager_prefix("run", "abcdef0123456789abcd", 1) == "run_abcdef0123456789"
    ours = {progress_key("run"), checksum_key("run", 3), averager_prefix("run", "abcdef0123456789")}
    assert all(f"_v{PROTOCOL_VERSION}" in name for name in ours)
    theirs = {progress_key("run", v) for v in neighbours()} | {checksum_key("run", 3, v) for v in neighbours()}
    assert not ours & theirs
    assert 1 in neighbours() and PROTOCOL_VERSION not in neighbours() and PROTOCOL_VERSION + 1 in neighbours()
    assert versioned("progress") in ProgressSchema.__fields__


def test_a_record_of_another_version_is_dropped_and_nobody_is_banned() -> None:
    assert isinstance(_parse_progress(SIGNED, ValueWithExpiration(GOOD, 10.0), now=0.0), PeerProgress)
    legacy = {k: v for k, v in GOOD.items() if k not in ("protocol", "phase_s")}  # what version 1 wrote
    for value in (legacy, dict(GOOD, protocol=PROTOCOL_VERSION + 1, extra=1)):
        parsed = _parse_progress(SIGNED, ValueWithExpiration(value, 10.0), now=0.0)
        assert parsed.kind == "version" and parsed.owner is None, parsed  # an owner would be banned
        assert "another release" in parsed.detail
    # The guard every node runs on receipt: a correctly signed record of a newer release under our key (one that
    # changed a field but forgot to bump the key) is refused as "version", not "malformed" (which bans).
    guard = RecordGuard(schemas=[SchemaValidator(ProgressSchema, prefix="run")], signed_keys=[progress_key("run")])
    key = DHTID.generate(source=progress_key("run")).to_bytes()
    for value, kind in ((dict(GOOD, protocol=PROTOCOL_VERSION + 1, phase_s="new"), "version"),
                        (dict(GOOD, phase_s="new"), "malformed"), (GOOD, None)):
        record = DHTRecord(key, MSGPackSerializer.dumps(SIGNED), MSGPackSerializer.dumps(value), 10.0)
        record = DHTRecord(key, record.subkey, RSASignatureValidator(KEY).sign_value(record), 10.0)
        verdict = guard.judge(record)
        assert (verdict.kind if verdict else None) == kind, verdict
        assert verdict is None or verdict.owner == (None if kind == "version" else PEER.to_base58())


def test_doctor_reports_a_version_mismatch() -> None:
    from p2p_diloco.cli.doctor import classify_versions

    assert classify_versions({}, ["a record"], "r") is None
    mixed = classify_versions({1: 2}, ["a record"], "r")
    assert mixed.status == "warn" and "2 peer(s) on protocol version 1" in mixed.detail
    assert f"speaks version {PROTOCOL_VERSION}" in mixed.detail and "release" in mixed.fix
    alone = classify_versions({PROTOCOL_VERSION + 1: 3}, [], "r")
    assert alone.status == "fail" and "train alone" in alone.detail
