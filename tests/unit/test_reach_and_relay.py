"""Who can dial whom (swarm/reach.py), the relay settings of the p2p daemon (swarm/relay.py) and the stall
gauge: the pure decisions behind the home-network tests (tests/integration/test_nat_swarm.py)."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P

from p2p_diloco.core.rounds import Outcome, RoundReport, Stall
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.monitoring.peer_metrics import PeerMetrics
from p2p_diloco.swarm import relay
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.reach import MESSAGES, Reach, diagnose, is_public, own_reach

STATS = InnerStats(steps=0, samples=0, tokens=0, seconds=0.0, mean_loss=float("nan"), last_loss=float("nan"))
ID = "QmcjU9dF4vUeye8mH2snwZNLcLDYqU2QJMixH6YvM52bLW"
BOOT = f"/ip4/11.77.0.1/tcp/4000/p2p/{ID}"
LAN = [f"/ip4/127.0.0.1/tcp/5/p2p/{ID}", f"/ip4/192.168.1.2/tcp/5/p2p/{ID}"]


def test_own_reach_from_announced_addresses() -> None:
    assert own_reach(LAN, client_mode=True) is Reach.CLIENT
    assert own_reach(LAN, client_mode=False) is Reach.PRIVATE
    assert own_reach([*LAN, f"{BOOT}/p2p-circuit/p2p/{ID}"], client_mode=False) is Reach.RELAYED
    assert own_reach([*LAN, f"/ip4/11.77.0.3/tcp/31338/p2p/{ID}"], client_mode=False) is Reach.PUBLIC
    assert not is_public("/ip4/10.1.2.3/tcp/1") and not is_public("not an address") and is_public(BOOT)


def test_diagnose_names_only_swarms_that_cannot_average() -> None:
    assert diagnose(Reach.CLIENT, full_peers_seen=0, initial_peers=[BOOT]) is Stall.ALL_CLIENTS
    assert diagnose(Reach.CLIENT, full_peers_seen=1, initial_peers=[BOOT]) is Stall.NONE
    assert diagnose(Reach.PRIVATE, full_peers_seen=2, initial_peers=[BOOT]) is Stall.UNREACHABLE
    # a swarm on one network (loopback, a LAN): private addresses are how everybody reaches everybody
    assert diagnose(Reach.PRIVATE, full_peers_seen=2, initial_peers=[LAN[1]]) is Stall.NONE
    assert diagnose(Reach.RELAYED, full_peers_seen=0, initial_peers=[BOOT]) is Stall.NONE
    assert diagnose(Reach.PUBLIC, full_peers_seen=0, initial_peers=[BOOT]) is Stall.NONE
    for message in MESSAGES.values():
        assert "Fix:" in message and "--announce-maddrs" in message


def test_relay_settings_per_role() -> None:
    home = SwarmConfig(initial_peers=[BOOT], use_auto_relay=True)
    assert relay.daemon_kwargs(home) == {"force_reachability": "private", "trusted_relays": [BOOT]}
    assert relay.daemon_kwargs(SwarmConfig(relay_service=True)) == {"force_reachability": "public"}
    assert relay.daemon_kwargs(SwarmConfig(initial_peers=[BOOT])) == {}
    # only daemons that name trusted relays lose relay discovery
    relay.install()
    relay.install()  # idempotent: wrapped once
    assert "-relayDiscovery=0" in P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=BOOT)
    assert not any("relayDiscovery" in a for a in P2P._make_process_args("p2pd", autoRelay=True))
    assert not any("relayDiscovery" in a for a in P2P._make_process_args("p2pd", autoRelay=False, trustedRelays=BOOT))


@pytest.mark.parametrize("kwargs, words", [
    ({"use_auto_relay": True, "use_relay": False}, "use_auto_relay needs use_relay"),
    ({"use_auto_relay": True, "relay_service": True}, "contradict"),
    ({"relay_service": True, "use_relay": False}, "relay_service needs use_relay"),
])
def test_relay_flags_that_cannot_work_are_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SwarmConfig(initial_peers=[BOOT], **kwargs)


def _value(metrics: PeerMetrics, cause: str) -> float:
    return metrics.registry.get_sample_value("p2p_diloco_swarm_stalled", {"cause": cause})


def test_stall_gauge_follows_the_rounds() -> None:
    metrics = PeerMetrics()
    assert _value(metrics, "all_clients") == 0 and _value(metrics, "unreachable") == 0
    metrics.round(RoundReport(epoch=0, outcome=Outcome.SKIPPED, stall=Stall.ALL_CLIENTS), STATS)
    assert _value(metrics, "all_clients") == 1 and _value(metrics, "unreachable") == 0
    metrics.round(RoundReport(epoch=0, outcome=Outcome.SKIPPED), STATS)  # another skip: unchanged
    assert _value(metrics, "all_clients") == 1
    metrics.round(RoundReport(epoch=0, outcome=Outcome.AVERAGED, new_epoch=1), STATS)
    assert _value(metrics, "all_clients") == 0
