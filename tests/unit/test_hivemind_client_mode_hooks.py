"""Tripwire: the hivemind internals that client mode relies on are still where ``swarm/runner.py`` and
``swarm/state.py`` expect them. A hivemind upgrade that moves them fails here, not in a stalled swarm."""

from __future__ import annotations

import inspect

from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager

from p2p_diloco.swarm.runner import CountingAllReduceRunner


def test_result_delay_of_clients_is_decided_by_should_delay_results() -> None:
    # CountingAllReduceRunner overrides it (never delay): hivemind must still ask it on both sides
    source = inspect.getsource(AllReduceRunner)
    assert "self.should_delay_results(self.peer_id)" in source  # a client as sender
    assert "self.should_delay_results(context.remote_id)" in source  # its reducers
    assert CountingAllReduceRunner.should_delay_results is not AllReduceRunner.should_delay_results


def test_client_mode_averagers_refuse_to_share_state() -> None:
    # StateServer.publish skips serving in client mode because hivemind raises here
    setter = inspect.getsource(DecentralizedAverager.allow_state_sharing.fset)  # type: ignore[union-attr]
    assert "client_mode" in setter and "raise ValueError" in setter
