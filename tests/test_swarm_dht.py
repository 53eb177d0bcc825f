"""DHT start-up errors, identity key handling, record validation and interoperability with hivemind-dht."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
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
    start_dht,
    visible_maddrs,
)
from p2p_diloco.swarm.records import checksum_key, progress_key

pytestmark = pytest.mark.timeout(60)
assert SHARED_MEMORY_KEEPALIVE.is_shared()

UNKNOWN_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPWyjpgDrvDMn46Chm4HXcF9StX9GF64BXSL17zVSUBPq"
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


def test_records_drop_malformed_and_expired_entries(dht: hivemind.DHT) -> None:
    run = "records"
    install_validators(dht, run)
    relay = start_dht(SwarmConfig.for_loopback(initial_peers=visible_maddrs(dht)))  # no validator installed
    try:
        assert publish_progress(
            dht,
            run,
            epoch=3,
            inner_step=7,
            steps_per_s=2.5,
            samples_per_s=10.0,
            tokens_per_s=5e3,
            fingerprint="abcdef0123456789",
        )
        now = get_dht_time()
        good = dict(
            epoch=9,
            inner_step=1,
            steps_per_s=1.0,
            samples_per_s=1.0,
            tokens_per_s=1.0,
            fingerprint="abcdef0123456789",
            time=now,
            client_mode=False,
        )
        malformed = [
            dict(good, epoch=9.0),  # would need a type conversion
            dict(good, epoch="9"),
            dict(good, steps_per_s=float("nan")),
            dict(good, tokens_per_s=float("inf")),
            dict(good, fingerprint="x" * 10_000),
            dict(good, extra_field=1),
            "not a dict",
        ]
        for subkey, value in zip(FAKE_IDS, malformed, strict=False):
            relay.store(progress_key(run), subkey=subkey, value=value, expiration_time=now + 60)
        relay.store(progress_key(run), subkey="not a peer id", value=good, expiration_time=now + 60)
        short_lived = get_dht_time() + 2.0
        relay.store(
            progress_key(run), subkey=FAKE_IDS[8], value=dict(good, epoch=50), expiration_time=short_lived
        )
        relay.store(
            progress_key(run),
            subkey=FAKE_IDS[9],
            value=dict(good, epoch=4, client_mode=True),
            expiration_time=now + 60,
        )
        valid = {dht.peer_id.to_base58(), FAKE_IDS[8], FAKE_IDS[9]}
        for reader in (dht, relay):
            records = fetch_progress(reader, run)
            assert {r.peer_id for r in records} == valid
            mine = [r for r in records if r.peer_id == dht.peer_id.to_base58()]
            assert len(mine) == 1 and mine[0].epoch == 3 and mine[0].steps_per_s == 2.5
        assert global_epoch(records) == 50
        assert global_epoch(records, min_peers=2) == 3  # the client's epoch 4 does not count
        assert global_epoch(records, min_peers=3) is None
        deadline = time.monotonic() + 20
        while FAKE_IDS[8] in {r.peer_id for r in records} and time.monotonic() < deadline:
            time.sleep(0.2)
            records = fetch_progress(relay, run)
        assert get_dht_time() > short_lived and {r.peer_id for r in records} == valid - {FAKE_IDS[8]}
        assert global_epoch(records) == 3

        sha_a, sha_b = "a" * 64, "b" * 64
        assert publish_checksum(dht, run, 3, sha_a)
        assert publish_checksum(relay, run, 3, sha_a)
        relay.store(checksum_key(run, 3), subkey=FAKE_IDS[0], value=sha_b, expiration_time=now + 60)
        relay.store(checksum_key(run, 3), subkey=FAKE_IDS[1], value="zz", expiration_time=now + 60)
        relay.store(checksum_key(run, 3), subkey=FAKE_IDS[2], value=12345, expiration_time=now + 60)
        assert fetch_checksums(dht, run, 3) == {
            dht.peer_id.to_base58(): sha_a,
            relay.peer_id.to_base58(): sha_a,
            FAKE_IDS[0]: sha_b,
        }
        assert majority_checksum(dht, run, 3) == (sha_a, 2, 3)
        assert majority_checksum(dht, run, 4) == (None, 0, 0)
        with pytest.raises(ValueError, match="64 lowercase hex"):
            publish_checksum(dht, run, 3, "A" * 64)
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
    helper = Path(__file__).parent / "swarm_helpers" / "interop.py"
    script = f'"{ip}" link set lo up && exec "{sys.executable}" "{helper}" "{out}"'
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
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
