"""DHT stores run on the writer's thread: the caller never waits on a slow DHT, and only the latest store of
a slot is kept while one is in flight."""

from __future__ import annotations

import threading

from p2p_diloco.swarm.dht_writer import MAX_SLOTS, DhtWriter


def test_a_slow_store_never_holds_up_the_caller_and_newer_progress_replaces_waiting_progress() -> None:
    writer = DhtWriter()
    release, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> None:  # a DHT that does not answer
        started.set()
        release.wait(30)
        ran.append("slow")

    writer.submit("checksum 1", slow)
    assert started.wait(30)
    for step in range(5):  # the training thread publishes progress while the store above hangs
        writer.submit("progress", lambda step=step: ran.append(f"progress {step}"))
    writer.submit("boom", lambda: 1 / 0)  # a failing store is logged, the writer goes on
    writer.submit("checksum 2", lambda: ran.append("checksum 2"))
    assert ran == []  # submit returned each time while the first store still hangs
    release.set()
    assert writer.flush(30)
    assert ran == ["slow", "progress 4", "checksum 2"]
    writer.close(5)
    writer.submit("progress", lambda: ran.append("late"))  # after close: dropped
    assert ran[-1] == "checksum 2"


def test_the_backlog_is_bounded() -> None:
    writer = DhtWriter()
    release, started = threading.Event(), threading.Event()
    writer.submit("hang", lambda: (started.set(), release.wait(30)))
    assert started.wait(30)  # the writer is busy: everything below waits in the backlog
    ran: list[int] = []
    for i in range(MAX_SLOTS + 10):
        writer.submit(f"checksum {i}", lambda i=i: ran.append(i))
    release.set()
    assert writer.flush(30)
    assert len(ran) <= MAX_SLOTS and ran[-1] == MAX_SLOTS + 9  # the oldest waiting ones were dropped
    writer.close(5)


def test_a_peer_publishes_in_the_background_and_reads_never_raise_when_the_dht_is_gone() -> None:
    import torch

    from p2p_diloco.swarm import SwarmConfig
    from p2p_diloco.swarm.dht import start_dht
    from p2p_diloco.swarm.facade import Swarm
    from p2p_diloco.swarm.signing import record_audit

    cfg = SwarmConfig.for_loopback()
    swarm = Swarm(cfg, "ab" * 8, [torch.zeros(2)])
    swarm.dht = start_dht(cfg)  # the real DHT node; no averager is needed for records
    swarm.audit = record_audit(swarm.dht)
    try:
        swarm.publish_progress(epoch=3, inner_step=7, rates=(1.0, 2.0, 3.0))  # returns at once
        assert swarm.flush_publications(60)
        assert [(r.epoch, r.inner_step) for r in swarm.records()] == [(3, 7)]
    finally:
        swarm.dht.shutdown()
    # the DHT is gone: reads answer from what was read last (records) or nothing (all_records), never raise
    assert [r.epoch for r in swarm.records()] == [3]
    assert swarm.all_records() == []
    swarm.publish_progress(epoch=4, inner_step=0, rates=(1.0, 2.0, 3.0))  # logged by the writer, not raised
    assert swarm.flush_publications(60)
    swarm.close()  # stops the writer (the DHT is already down)
