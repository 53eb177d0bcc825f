"""A node's inner phase (DDP and FSDP2 over 2 gloo ranks) gives the outer step a single process gives on the
same data; after the scatter every rank's parameters hash alike. Real processes, no swarm."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import node_ranks
import pytest
import torch
from safetensors.torch import load_file
from swarm_procs import env

from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.models import build_model
from p2p_diloco.peer.node import NodeLaunch
from p2p_diloco.peer.node_session import combine_stats
from p2p_diloco.trainer import InnerTrainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_and_fsdp2_give_a_single_process_outer_step(tmp_path: Path) -> None:
    port = _free_port()
    ranks = [subprocess.Popen([sys.executable, node_ranks.__file__, str(r), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
             for r in range(node_ranks.RANKS)]
    # The reference meanwhile: one process, the node's global batches, the same outer step.
    r = node_ranks
    model = build_model("tiny", r.VOCAB, r.SEQ, seed=0)
    state = OuterState(list(model.parameters()), lr=0.7, momentum=0.9, device="cpu")
    InnerTrainer(model, r.inner(r.RANKS * r.PER_RANK), r.batches(None)).train_steps(r.STEPS)
    r.outer_step(state, list(model.parameters()))
    start = list(build_model("tiny", r.VOCAB, r.SEQ, seed=0).parameters())
    for proc in ranks:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
    for mode in r.MODES:
        node = load_file(tmp_path / f"{mode}.safetensors")
        ranks_digest, anchors_digest = (tmp_path / f"{mode}.sha256").read_text().split()
        assert ranks_digest == anchors_digest, mode  # every rank holds exactly rank 0's new anchors
        for i, (ours, first) in enumerate(zip(state.anchors, start, strict=True)):
            assert (ours - first).abs().max().item() > 1e-4, (mode, i)  # it moved: the comparison is not vacuous
            torch.testing.assert_close(node[f"p{i}"], ours, rtol=1e-4, atol=2e-5, msg=f"{mode} param {i}")


def test_launch_is_read_from_torchruns_environment() -> None:
    assert NodeLaunch.from_env({}) is None and NodeLaunch.from_env({"WORLD_SIZE": "1"}) is None
    env = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert NodeLaunch.from_env(env) == NodeLaunch(2, 4, 2)
    for bad, needle in (({"RANK": "x"}, "RANK"), ({"RANK": "4"}, "below WORLD_SIZE"),
                        ({"MASTER_PORT": ""}, "MASTER_PORT")):
        with pytest.raises(ValueError, match=needle):
            NodeLaunch.from_env({**env, **bad})


def test_node_stats_sum_work_and_take_the_slowest_rank() -> None:
    s = combine_stats([[10, 8, 512, 2.0, 3.0, 2.0], [10, 8, 512, 3.0, 5.0, 4.0]])
    assert (s.steps, s.samples, s.tokens, s.seconds, s.mean_loss, s.last_loss) == (10, 16, 1024, 3.0, 4.0, 3.0)
    assert s.tokens_per_second == pytest.approx(1024 / 3.0)


def test_node_flags_are_checked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from p2p_diloco.cli import run_peer
    from p2p_diloco.cli.common import make_parser, parse_config
    from p2p_diloco.peer.config import PeerConfig

    parser = make_parser("run_peer", "", PeerConfig)
    cfg, _ = parse_config(parser, PeerConfig, ["--node-parallel", "fsdp2", "--node-timeout-s", "1300"])
    assert (cfg.node.parallel, cfg.node.timeout_s) == ("fsdp2", 1300.0)
    for argv, needle in ((["--node-timeout-s", "600"], "--node-timeout-s"), (["--node-parallel", "tp"], "node")):
        with pytest.raises(SystemExit) as exit_info:
            parse_config(parser, PeerConfig, argv)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    # Under torchrun each rank takes cuda:LOCAL_RANK: a fixed device is refused before any process group starts.
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        run_peer._join_node(parse_config(parser, PeerConfig, ["--device", "cuda:1"])[0])
    assert exit_info.value.code == 2 and "cuda:LOCAL_RANK" in capsys.readouterr().err
