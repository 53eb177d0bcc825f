"""A donor that handed out its manifest still serves that state when the joiner's first chunk request comes: the
joiner asks for chunks only after the other donors' manifests had their whole grace (one silent directory
entry: a peer gone, an attacker), so the donor's pin outlasts that grace. With a 2 s pin and the 5 s grace, donors
of rounds shorter than the grace stepped on in the gap and a peer behind a dead entry never caught up
(``tests/integration/test_poisoned_catch_up.py``: 0 chunks from either honest donor, download after download)."""

from __future__ import annotations

import time

from p2p_diloco.core.chunks import MANIFEST_GRACE_S, manifest_wait_s
from p2p_diloco.swarm.chunk_transfer import ServingCounters

REQUEST_S = 1.0
"""What a loaded joiner takes between the end of its manifest wait and its first chunk request reaching the donor
(the manifests checked, the request sent through the averager process)."""


def test_a_donor_that_answered_first_is_still_serving_when_the_chunks_are_asked_for() -> None:
    first_s = 0.01  # an honest donor on the joiner's network answers at once; another entry never answers
    gap_s = manifest_wait_s(first_s, 30.0) - first_s + REQUEST_S
    assert gap_s >= MANIFEST_GRACE_S
    counters = ServingCounters()
    counters.last_served.value = time.time() - gap_s  # the manifest served that long ago, nothing since
    assert counters.downloading()


def test_a_donor_nobody_asked_for_a_while_is_free_to_step_on() -> None:
    counters = ServingCounters()
    assert not counters.downloading()
    counters.last_served.value = time.time() - 10 * (MANIFEST_GRACE_S + REQUEST_S)
    assert not counters.downloading()
