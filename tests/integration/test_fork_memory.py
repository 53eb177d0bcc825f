"""The swarm's forked processes keep no private copies of the tensors the training process writes.

A real ``SwarmSession`` in its own process starts its DHT and averager (hivemind forks both), then writes
every value of its CPU weights and anchors, as an inner phase and an outer step do. The forked processes'
proportional set size must not grow by the bytes written. Before the tensors were put in shared memory ahead
of the fork, the forked processes kept the pre-write pages between them: a page the three processes shared
became one the two children share, so their PSS grew by a third of the weights (about 20 MiB here), and the
anchors' pre-fork pages stayed in them whole (their unique set size does not show it, as both keep them).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MIB = 2**20
SESSION = r"""
import json, sys, psutil, torch
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.session import SwarmSession
from p2p_diloco.swarm.config import SwarmConfig

cfg = PeerConfig()
cfg.swarm = SwarmConfig.for_loopback(run_id="forkmem")
params = [torch.nn.Parameter(torch.randn(4_000_000)), torch.nn.Parameter(torch.randn(2000, 2000))]
session = SwarmSession(cfg, params, "abcdef0123456789")
session.start()
me = psutil.Process()

def children_pss():
    total = 0
    for child in me.children(recursive=True):
        if child.name().startswith("python"):  # the DHT and averager processes, not p2pd or torch's manager
            total += child.memory_full_info().pss
    return total

before = children_pss()
with torch.no_grad():
    for p in params:
        p.add_(1.0)  # an inner phase writes every weight
    for a in session.state.anchors:
        a.mul_(0.5)  # an outer step writes every anchor
after = children_pss()
shared = all(t.is_shared() for t in [*params, *session.state.anchors])
print(json.dumps({"before": before, "after": after, "written": 2 * 8_000_000 * 4, "shared": shared}), flush=True)
session.close()
"""


def test_forked_processes_do_not_keep_copies_of_the_weights_and_anchors() -> None:
    done = subprocess.run([sys.executable, "-c", SESSION], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["shared"], out
    grown = out["after"] - out["before"]
    # 64 MB written; with copy-on-write copies the two forked processes together grew by 20 MiB
    assert grown < out["written"] / 16, (grown / MIB, out)

