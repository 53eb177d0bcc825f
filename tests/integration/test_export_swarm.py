"""A live 2-peer swarm on a fast BPE tokenizer and a hub-layout dataset: export and eval from the swarm and
from a checkpoint, TensorBoard tracking and the round-log plot, all checked against what the peers logged.

One swarm serves every check, to keep the suite lean: the peers (real processes) train on
``hf:FOLDER`` (parquet shards + README, the ``datasets`` path of hub datasets) with ``--tokenizer FOLDER``,
peer a logs to TensorBoard; while both run, ``run_peer export`` and ``run_peer eval`` download the swarm's
verified state in this process; after they stop, the exported folder is compared with the peers' own
checkpoints, checksums and evaluations.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_assets import corpus, make_bpe_tokenizer, make_hub_dataset
from swarm_procs import FAST, SYNCED, events, kill_tree, start_peer, tail, wait_for
from transformers import AutoModelForCausalLM

from p2p_diloco.build import build_model_and_tokenizer
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.cli import evaluate, export, plot
from p2p_diloco.cli.common import make_parser, parse_config
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.swarm import SwarmConfig, params_sha256, start_dht, visible_maddrs


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Two threads on two shared cores: OpenMP's waits cost more than they bring (5x slower evals here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids).logits


def _own_eval(tmp: Path, epoch: int) -> tuple[float, str]:
    """The eval loss and checksum a peer logged for the parameters of ``epoch`` (reached through the swarm)."""
    rows = [r for n in ("a", "b") for r in events(tmp, n, "round")
            if r["new_epoch"] == epoch and r["outcome"] in SYNCED and r["eval_loss"] is not None]
    assert rows, (epoch, [(r["new_epoch"], r["outcome"]) for n in "ab" for r in events(tmp, n, "round")])
    return rows[0]["eval_loss"], rows[0]["params_sha256"]


@pytest.mark.slow
@pytest.mark.long
def test_export_and_eval_from_a_live_swarm_and_its_checkpoints(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    tok = make_bpe_tokenizer(tmp_path / "tokenizer", corpus("train", 2000))
    hub = make_hub_dataset(tmp_path / "hub", corpus("train", 6000), corpus("eval", 200))
    # short rounds: the test needs a few averaged epochs, not much training
    run = [*FAST, "--run-id", "export-t", "--tokenizer", str(tok), "--dataset", f"hf:{hub}", "--virtual-shards", "2",
           "--local-steps", "5", "--min-local-steps", "5"]
    # the bootstrap node runs in this process (a bootstrap's DHT node as run_bootstrap starts it): one Python
    # start-up less on a shared two-core machine
    bootstrap = start_dht(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    maddr = visible_maddrs(bootstrap)[0]
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("a", "b"):
            tracking = ["--tensorboard-dir", str(tmp_path / "tb")] if name == "a" else []
            procs[name] = start_peer(tmp_path, name, maddr, *run[len(FAST):], "--max-rounds", "40",
                                     "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--keep-checkpoints", "50", "--checkpoint-every", "1",
                                     *tracking)
        wait_for(lambda: all(any(r["outcome"] == "averaged" and r["group_size"] == 2 for r in events(tmp_path, n, "round"))
                             for n in ("a", "b")), 240,
                 lambda: "a round averaged by both peers: " + tail(tmp_path, "a", 600))
        swarm = [*run, "--initial-peers", maddr]
        capsys.readouterr()
        assert export.main([*swarm, "--output", str(tmp_path / "live")]) == 0, capsys.readouterr().err
        assert evaluate.main([*swarm, "--json"]) == 0, capsys.readouterr().err
        live_eval = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert all(p.poll() is None for p in procs.values()), "a peer stopped while the swarm was read"
    finally:
        for proc in procs.values():  # a lost machine: what was logged and checkpointed is all there is
            kill_tree(proc)
        bootstrap.shutdown()

    # the live export holds the swarm's parameters of its epoch: the checksum every member published
    info = json.loads((tmp_path / "live" / "p2p_diloco.json").read_text())
    epoch = info["epoch"]
    assert info["source"] == "swarm" and epoch >= 1
    own_loss, own_sha = _own_eval(tmp_path, epoch)
    assert info["params_sha256"] == own_sha
    # ... and gives the logits of the peers' model (built by p2p_diloco from a peer's checkpoint of that epoch)
    cfg, _ = parse_config(make_parser("run_peer", "", PeerConfig), PeerConfig, run)
    tokenizer, reference = build_model_and_tokenizer(cfg)
    checkpoint = next(ck for ck in (tmp_path / "ckpt-a" / f"ckpt-{epoch:08d}", tmp_path / "ckpt-b" / f"ckpt-{epoch:08d}")
                      if ck.is_dir())
    tensors = load_checkpoint(checkpoint).tensors
    with torch.no_grad():
        for i, p in enumerate(reference.parameters()):
            p.copy_(tensors[f"param.{i}"])
    assert params_sha256([p.detach() for p in reference.parameters()]) == own_sha
    live = AutoModelForCausalLM.from_pretrained(tmp_path / "live")
    torch.testing.assert_close(_logits(live, tokenizer.vocab_size), _logits(reference, tokenizer.vocab_size),
                               rtol=1e-5, atol=1e-5)

    # the same epoch exported from a checkpoint (the other peer's when it saved that epoch too): same logits
    other = tmp_path / ("ckpt-b" if checkpoint.parent.name == "ckpt-a" else "ckpt-a") / f"ckpt-{epoch:08d}"
    source = other if other.is_dir() else checkpoint
    assert export.main([*run, "--checkpoint-dir", str(source), "--output", str(tmp_path / "from-ckpt")]) == 0
    from_ckpt = AutoModelForCausalLM.from_pretrained(tmp_path / "from-ckpt")
    torch.testing.assert_close(_logits(from_ckpt, tokenizer.vocab_size), _logits(live, tokenizer.vocab_size),
                               rtol=1e-5, atol=1e-5)

    # eval of the exported folder (its own tokenizer, the run's held-out split) = the peers' own eval
    capsys.readouterr()
    assert evaluate.main([*FAST, "--model", str(tmp_path / "live"), "--dataset", f"hf:{hub}", "--json"]) == 0
    folder_eval = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert folder_eval["epoch"] == epoch and folder_eval["loss"] == pytest.approx(own_loss, rel=1e-5)
    # the live eval read some epoch of the running swarm: the peers logged the same loss for it
    assert live_eval["source"] == "swarm" and live_eval["loss"] == pytest.approx(_own_eval(tmp_path, live_eval["epoch"])[0],
                                                                                rel=1e-5)

    # peer a's TensorBoard events hold every round it logged, with the same losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb_dir,) = (tmp_path / "tb").iterdir()
    assert tb_dir.name == events(tmp_path, "a", "start")[0]["peer_id"]
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    rounds = events(tmp_path, "a", "round")
    logged = [e.value for e in accumulator.Scalars("train/loss")]
    # the tracker hears of a round just before its log line is written: a kill in between leaves one more
    assert rounds and len(logged) - len(rounds) in (0, 1)
    assert logged[:len(rounds)] == pytest.approx([r["train_loss"] for r in rounds], rel=1e-6)
    assert [e.value for e in accumulator.Scalars("round/group_size")][:len(rounds)] == [r["group_size"] for r in rounds]

    # both peers' logs drawn as one picture
    png = tmp_path / "rounds.png"
    assert plot.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--output", str(png)]) == 0
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[:2] == (850, 1300)
    assert pixels[..., :3].std() > 0.05 and len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).tolist()}) > 20
