"""Stopping a peer whose averager process got the signal first (SIGTERM to the whole process group)."""

from __future__ import annotations

import logging
import os
import signal

import torch
from swarm_helpers.harness import SHARED_MEMORY_KEEPALIVE

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
    assert errors.messages == []
