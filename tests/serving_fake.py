"""An averager that serves state without hivemind (``swarm.state.ServingAverager``): what ``StateServer`` hands
it is kept for the test to read (``provider``), and manifests handed out are counted (``served``)."""

from __future__ import annotations

from typing import Any


class FakeServing:
    client_mode = False

    def __init__(self) -> None:
        self.cfg = type("Cfg", (), {"run_id": "run"})()
        self.fingerprint = "fp"
        self.state_sharing_priority = 0.0
        self.served, self.bumps = 0, 0
        self.live = False
        self.provider: Any = None

    def is_alive(self) -> bool:
        return True

    def downloading(self) -> bool:
        return False

    def manifests_served(self) -> int:
        return self.served

    def bump_state_version(self) -> None:
        self.bumps += 1

    def mark_state_live(self, live: bool) -> None:
        self.live = live

    def set_state_provider(self, provider: Any) -> None:
        self.provider = provider
