"""Launch swarm peers (tests/swarm_helpers/peer.py) as real processes on loopback and collect their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind  # noqa: F401  (sets torch's sharing strategy to "file_system", see below)
import torch

# hivemind makes torch share tensors through the "file_system" strategy, whose torch_shm_manager daemon is a
# child of the first process that shares a tensor. Start it here, while tests are being collected: started
# inside a test, the suite's child reaper would kill it after that test, and the next shared tensor freed in
# this process would abort the interpreter ("terminate called ... Broken pipe").
SHARED_MEMORY_KEEPALIVE = torch.zeros(1).share_memory_()

PEER_SCRIPT = Path(__file__).with_name("peer.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Peer:
    name: str
    spec: dict[str, Any]
    proc: subprocess.Popen
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"


def _worth_showing(line: str) -> bool:
    """Warnings and errors, hivemind's averaging steps (matchmaking, all-reduce: DEBUG, see ``Swarm.spawn``)
    and our own log lines: about ten lines per peer in a round that went well."""
    return any(mark in line for mark in ("WARN", "ERROR", "hivemind.averaging", "p2p_diloco."))


class Swarm:
    """A set of peer processes sharing one bootstrap address, released together by a 'go' file."""

    def __init__(self, workdir: Path, initial_peers: list[str]):
        self.workdir, self.initial_peers = workdir, initial_peers
        self.go_path = workdir / "go"
        self.stop_path = workdir / "stop"
        self.peers: list[Peer] = []

    def spawn(self, name: str, **spec: Any) -> Peer:
        spec = dict(spec)
        spec.setdefault("initial_peers", self.initial_peers)
        spec.update(
            ready_path=str(self.workdir / f"{name}.ready.json"),
            out_path=str(self.workdir / f"{name}.out.json"),
            go_path=str(self.go_path),
            stop_path=str(self.stop_path),
        )
        spec_path = self.workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.workdir / f"{name}.log"
        # hivemind at DEBUG: its matchmaking lines (who asked whom, who was accepted, who assembled) are what
        # tells a lost round apart when a test fails on a loaded machine (see ``warnings``)
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="DEBUG")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(PEER_SCRIPT), str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group, so a fault hook can SIGKILL the whole peer
            )
        peer = Peer(name, spec, proc, log_path)
        self.peers.append(peer)
        return peer

    def wait_ready(self, timeout: float = 45.0) -> None:
        """Poll until every peer wrote its ready file (or died), then release them all at once."""
        deadline = time.monotonic() + timeout
        pending = list(self.peers)
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                path = Path(peer.spec["ready_path"])
                if path.exists():
                    peer.info = json.loads(path.read_text())
                    pending.remove(peer)
                elif peer.proc.poll() is not None:
                    raise AssertionError(f"peer {peer.name} exited early:\n{peer.log_tail()}")
            time.sleep(0.05)
        if pending:
            raise AssertionError(
                f"peers not ready in time: {[p.name for p in pending]}\n{pending[0].log_tail()}"
            )
        self.go_path.write_text("go")

    def result(self, peer: Peer, timeout: float = 50.0) -> dict[str, Any]:
        """Wait for ``peer`` to exit and return its output JSON."""
        try:
            peer.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            peer.proc.kill()
            raise AssertionError(f"peer {peer.name} did not finish:\n{peer.log_tail()}") from None
        path = Path(peer.spec["out_path"])
        if not path.exists():
            raise AssertionError(
                f"peer {peer.name} wrote no result (rc={peer.proc.returncode}):\n{peer.log_tail()}"
            )
        return json.loads(path.read_text())

    def warnings(self) -> str:
        """For the message of a failed assertion: every peer's warnings and errors (hivemind's and ours), its
        matchmaking steps, and the outcome and reason of each peer that wrote a result."""
        lines = []
        for peer in self.peers:
            text = peer.log_tail(10**7)
            lines += [f"{peer.name}: {line[:300]}" for line in text.splitlines() if _worth_showing(line)]
        for peer in self.peers:
            path = Path(peer.spec["out_path"])
            if path.exists():
                out = json.loads(path.read_text())
                lines.append(
                    f"{peer.name} ({out.get('peer_id', '?')[-8:]}): {out.get('outcome')}: {out.get('reason')}"
                )
        return "\n".join(lines)

    def stop(self) -> None:
        self.stop_path.write_text("stop")
        for peer in self.peers:
            try:
                peer.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                peer.proc.kill()
                peer.proc.wait(timeout=5)
