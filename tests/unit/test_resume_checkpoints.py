"""``run_peer --resume``: a damaged only checkpoint stops the peer unless it asks to start fresh, and is never
overwritten; a checkpoint of another sequence length is refused like one of another model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2p_diloco.checkpoint import load_latest, save_checkpoint
from p2p_diloco.cli import run_peer
from p2p_diloco.config_loader import build
from p2p_diloco.models import build_model, model_fingerprint
from p2p_diloco.peer.config import PeerConfig

FLAGS = ["--model", "tiny", "--device", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "ck"]


def _checkpoint(root: Path, epoch: int, seq_len: int = 64) -> Path:
    model = build_model("tiny", 259, seq_len)
    manifest = {"run_id": "ck", "fingerprint": model_fingerprint(model, "tiny"), "model": "tiny",
                "seq_len": seq_len, "data_id": "x", "data_position": {"walk": 0, "row": 0}, "inner_step": 0}
    tensors = {f"param.{i}": p.detach() for i, p in enumerate(model.parameters())}
    return save_checkpoint(root, epoch, tensors, manifest)


def _damage(path: Path) -> None:
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "state.safetensors").write_bytes(bytes(data))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_damaged_only_checkpoint_stops_with_exit_2_and_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _damage(_checkpoint(tmp_path, 1))
    before = _files(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_peer.main([*FLAGS, "--seq-len", "64", "--checkpoint-dir", str(tmp_path), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the only checkpoint" in err[0] and "ckpt-00000001, is damaged" in err[0] and "sha256" in err[0]
    assert "--start-fresh" in err[0]
    assert _files(tmp_path) == before


def test_start_fresh_keeps_the_damaged_checkpoint_where_no_save_overwrites_it(tmp_path: Path) -> None:
    damaged = _checkpoint(tmp_path, 1)
    _damage(damaged)
    before = _files(damaged)
    cfg = build(PeerConfig, None, None, environ={},
                base={"model.seq_len": 64, "run.checkpoint_dir": str(tmp_path), "run.resume": True,
                      "run.start_fresh": True, "run.run_id": "ck"})
    assert run_peer._load_resume(cfg, "0" * 16) is None
    kept = tmp_path / "damaged-ckpt-00000001"
    assert _files(kept) == before and not damaged.exists()
    # the fresh start saves epoch 1 again, and keeps only one checkpoint: the damaged one is untouched
    save_checkpoint(tmp_path, 1, {"param.0": torch.zeros(3)}, {}, keep=1)
    assert _files(kept) == before
    assert load_latest(tmp_path).epoch == 1


def test_damaged_newest_is_skipped_and_kept_aside(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 1)
    _damage(_checkpoint(tmp_path, 2))
    cfg = build(PeerConfig, None, None, environ={},
                base={"model.seq_len": 64, "run.checkpoint_dir": str(tmp_path), "run.resume": True,
                      "run.run_id": "ck"})
    fingerprint = model_fingerprint(build_model("tiny", 259, 64), "tiny")
    ck = run_peer._load_resume(cfg, fingerprint)
    assert ck is not None and ck.epoch == 1
    assert (tmp_path / "damaged-ckpt-00000002" / "manifest.json").exists()


def test_resume_with_another_seq_len_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _checkpoint(tmp_path, 3, seq_len=64)
    with pytest.raises(SystemExit) as exit_info:
        run_peer.main([*FLAGS, "--seq-len", "128", "--checkpoint-dir", str(tmp_path), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seq_len 64, not 128" in err[0] and "--seq-len" in err[0], err


def test_start_fresh_needs_resume(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_peer.main([*FLAGS, "--start-fresh"])
    assert exit_info.value.code == 2
    assert "--start-fresh" in capsys.readouterr().err
