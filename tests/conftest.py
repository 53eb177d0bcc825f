"""Suite-wide fixtures: every test leaves no child process behind."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _reapable(proc: psutil.Process) -> bool:
    try:
        return proc.name() != "torch_shm_manager"
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def reap_children():
    """Kill any process a test started and left running (peers, DHT daemons, p2pd)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    me = psutil.Process()
    # torch's shared-memory manager is started once for the whole session (hivemind shares tensors
    # through it); killing it would abort the next shared tensor freed in this process.
    leftovers = [p for p in me.children(recursive=True) if p.pid not in before and _reapable(p)]
    for proc in leftovers:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(leftovers, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
