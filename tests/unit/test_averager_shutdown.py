"""Stopping a peer whose averager process got the signal first (SIGTERM to the whole process group)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys

import torch
from hivemind.utils.mpfuture import MPFuture
from swarm_helpers.harness import SHARED_MEMORY_KEEPALIVE

from p2p_diloco.core.rounds import Outcome
from p2p_diloco.swarm import SwarmConfig, start_dht
from p2p_diloco.swarm.averager import RoundAverager

assert SHARED_MEMORY_KEEPALIVE.is_shared()


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_shutdown_after_the_averager_process_died_logs_no_error() -> None:
    # hivemind's loggers do not propagate to the root logger (so caplog misses them): listen on them directly
    errors = _Errors()
    loggers = [logging.getLogger("hivemind.averaging.averager"), logging.getLogger("p2p_diloco")]
    for logger in loggers:
        logger.addHandler(errors)
    cfg = SwarmConfig.for_loopback()
    dht = start_dht(cfg)
    try:
        averager = RoundAverager([torch.zeros(8)], dht, cfg, fingerprint="ab" * 8)
        os.kill(averager.pid, signal.SIGTERM)  # what systemd or a terminal sends to every process of the peer
        averager.join(30)
        assert not averager.is_alive()
        averager.shutdown()
    finally:
        dht.shutdown()
        for logger in loggers:
            logger.removeHandler(errors)
        # hivemind's MPFutures share one lock among every process forked from this one. A process killed
        # while it sends a result (the averager may still be inside ``ready.set_result``) never releases it,
        # and every hivemind process started later in this pytest process then hangs on its first result
        # (seen: the next test's DHT never started). A peer is one process tree and stops after such a kill;
        # the test process goes on, so it takes fresh locks.
        MPFuture.reset_backend()
    assert errors.messages == []


def test_a_round_the_averager_process_never_takes_is_skipped_without_a_traceback_at_exit() -> None:
    # A peer stopped mid-round: its averager process stops answering before the step is handed over. hivemind's
    # StepControl asserts in __del__ that it was given a trigger; left bare it prints a traceback when collected.
    unraisable: list[str] = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda hook_args: unraisable.append(repr(hook_args.exc_value))
    cfg = SwarmConfig.for_loopback()
    dht = start_dht(cfg)
    try:
        averager = RoundAverager([torch.zeros(8)], dht, cfg, fingerprint="ab" * 8)
        # started with the usual bound (a loaded machine needs it); the hand-over of a step then gets 1 s
        averager.cfg = dataclasses.replace(cfg, startup_timeout_s=1.0)
        os.kill(averager.pid, signal.SIGSTOP)  # alive, but it takes no step
        try:
            result = averager.average([torch.ones(8)], weight=1.0, staleness=0, epoch=0)
        finally:
            os.kill(averager.pid, signal.SIGCONT)
        assert result.outcome is Outcome.SKIPPED and "could not start the round" in result.reason
        del result
        gc.collect()
        averager.shutdown()
    finally:
        dht.shutdown()
        sys.unraisablehook = previous_hook
    assert unraisable == []
