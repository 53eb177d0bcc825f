"""The session's docstring example is the loop run_peer really runs, and run_peer keeps to the contract."""

from __future__ import annotations

import inspect
import re

from p2p_diloco.cli import run_peer
from p2p_diloco.peer import session


def _code_lines(docstring: str) -> list[str]:
    block = docstring.split("::", 1)[1].split("\n\n", 2)[1]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]


def test_the_docstring_loop_is_run_peers_loop() -> None:
    source = {line.strip() for line in inspect.getsource(run_peer).splitlines()}
    lines = _code_lines(session.__doc__)
    assert len(lines) >= 12
    missing = [line for line in lines if line not in source]
    assert not missing, f"session.py's example differs from run_peer: {missing}"


def test_run_peer_reaches_the_session_only_through_its_contract() -> None:
    source = inspect.getsource(run_peer)
    private = re.findall(r"session\.(state|server|listeners|swarm|port|driver|_\w+)\b", source)
    assert not private, f"run_peer reaches into the session: {sorted(set(private))}"
    assert "scheduler" not in source and "save_checkpoint(" not in source


def test_state_dict_round_trips_outer_state_epoch_inner_step_and_data_position() -> None:
    import pytest
    import torch

    from p2p_diloco.data.loader import DataPosition
    from p2p_diloco.peer.config import PeerConfig

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    first = session.SwarmSession(PeerConfig(), params, "abcdef0123456789")  # nothing starts before start()
    first.state.anchors[0].fill_(1.5)
    first.state.epoch, first.inner_step = 7, 70

    class Stream:
        position = DataPosition(walk=2, row=5)

    first.bind_data(Stream())
    saved = first.state_dict()
    assert saved["epoch"] == 7 and saved["inner_step"] == 70 and saved["data_position"] == {"walk": 2, "row": 5}

    again = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    second = session.SwarmSession(PeerConfig(), again, "abcdef0123456789")
    second.load_state_dict({**saved, "data_id": "peer-a"})
    assert second.epoch == 7 and second.inner_step == 70 and second.data_id == "peer-a"
    assert second.data_position == DataPosition(2, 5) and again[0].tolist() == [1.5] * 3  # params = anchors
    assert second.state_dict()["data_position"] == {"walk": 2, "row": 5}
    for bad, needle in (({"inner_step": -1}, "inner_step"), ({"data_position": {"walk": -1}}, "data position"),
                        ({"epoch": -3}, "epoch")):
        with pytest.raises(ValueError, match=needle):
            second.load_state_dict({**saved, **bad})
