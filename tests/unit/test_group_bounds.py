"""Bounded group influence: bandwidth claims are ignored by load balancing among strangers, and the weight cap follows
from the run's configuration (batch size x local steps x a few rounds of carried work)."""

from __future__ import annotations

from hivemind.averaging.load_balancing import load_balance_peers

from p2p_diloco.peer.config import ROUNDS_OF_WORK, PeerConfig
from p2p_diloco.swarm.group import balancing_bandwidths


def test_a_bandwidth_claim_no_longer_buys_the_whole_vector() -> None:
    size = 10**6
    assert load_balance_peers(size, [1e9, 10.0, 10.0]) == (size, 0, 0)  # the finding, in hivemind itself
    assert load_balance_peers(size, [20.0, 10.0, 10.0]) == (size, 0, 0)  # even 2x does it: no cap is safe
    open_swarm = balancing_bandwidths([1e9, 10.0, 0.0, None], private=False)
    assert open_swarm == [None, None, 0.0, None]  # clients still reduce nothing
    shares = load_balance_peers(size, open_swarm)
    assert sum(shares) == size and shares[2] == 0 and max(shares) - min(s for s in shares if s) <= 1
    assert balancing_bandwidths([1e9, 10.0], private=True) == [1e9, 10.0]  # allowed peers are believed


def test_the_weight_cap_follows_the_run_configuration() -> None:
    cfg = PeerConfig()
    assert cfg.swarm.max_round_weight == ROUNDS_OF_WORK * cfg.inner.batch_size * cfg.outer.local_steps
    explicit = PeerConfig()
    explicit.swarm.max_round_weight = 5e5
    explicit.__post_init__()
    assert explicit.swarm.max_round_weight == 5e5
