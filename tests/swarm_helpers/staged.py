"""Single-round peers (``tests/swarm_helpers/peer.py``) each released by a go file of its own, so that a test
starts each one's round on an event it saw (a line in another peer's log), not after a sleep.

``step_back_peer.py`` runs a peer with ``quorum.STEP_BACK_LEAD_S`` taken from its spec (``step_back_lead_s``),
for tests that need the moments between stepping back and the next declaration to be long enough to hit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm_helpers.harness import REPO_ROOT, Peer, Swarm

STEP_BACK_PEER = Path(__file__).with_name("step_back_peer.py")


class StagedSwarm(Swarm):
    """A :class:`Swarm` whose peers each wait for their own go file (:meth:`release`), not one for all."""

    def spawn(self, name: str, script: Path = STEP_BACK_PEER, **spec: Any) -> Peer:
        spec = dict(spec)
        spec.setdefault("initial_peers", self.initial_peers)
        spec.update(ready_path=str(self.workdir / f"{name}.ready.json"), out_path=str(self.workdir / f"{name}.out.json"),
                    go_path=str(self.workdir / f"{name}.go"), stop_path=str(self.stop_path))
        spec_path = self.workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.workdir / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="DEBUG")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, str(script), str(spec_path)], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        peer = Peer(name, spec, proc, log_path)
        self.peers.append(peer)
        return peer

    def release(self, peer: Peer) -> None:
        """Start ``peer``'s round now."""
        Path(peer.spec["go_path"]).write_text("go")


def wait_for_log(peers: list[Peer], found: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Return ``found()`` once it is truthy (read every ``every`` s); fail after ``timeout`` s naming ``what``,
    with the peers' matchmaking lines, or as soon as a peer exited without it."""
    deadline = time.monotonic() + timeout
    while True:
        value = found()
        if value:
            return value
        if time.monotonic() > deadline or any(p.proc.poll() is not None for p in peers):
            lines = [f"{p.name}: {line[:300]}" for p in peers for line in p.log_tail(10**6).splitlines()
                     if "matchmaking" in line or "p2p_diloco" in line]
            raise AssertionError(f"never saw {what} within {timeout} s:\n" + "\n".join(lines[-80:]))
        time.sleep(every)


def log_has(peer: Peer, pattern: str) -> re.Match | None:
    """The first match of the regular expression ``pattern`` in ``peer``'s log so far."""
    return re.search(pattern, peer.log_tail(10**7))
