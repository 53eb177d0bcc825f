"""Checkpoints: atomic, verified on load, no pickle; a crash mid-write keeps the previous one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointError, load_latest, save_checkpoint


def _tensors(value: float, n: int = 1000) -> dict[str, torch.Tensor]:
    return {"param.0": torch.full((n,), value), "outer.momentum.0": torch.full((n,), -value)}


def test_round_trip_and_keep(tmp_path: Path) -> None:
    for epoch in range(5):
        save_checkpoint(tmp_path, epoch, _tensors(float(epoch)), {"run_id": "r", "data_position": {"walk": epoch}},
                        keep=2)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["ckpt-00000003", "ckpt-00000004"]
    ck = load_latest(tmp_path)
    assert ck is not None and ck.epoch == 4 and ck.manifest["data_position"] == {"walk": 4}
    assert torch.equal(ck.tensors["param.0"], torch.full((1000,), 4.0))


def test_damaged_newest_falls_back_to_previous(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1.0), {})
    newest = save_checkpoint(tmp_path, 2, _tensors(2.0), {})
    data = bytearray((newest / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "state.safetensors").write_bytes(bytes(data))
    ck = load_latest(tmp_path)
    assert ck is not None and ck.epoch == 1
    assert load_latest(tmp_path / "nothing-here") is None


WRITER = """
import sys, torch
from p2p_diloco.checkpoint import save_checkpoint
epoch = 100
print("ready", flush=True)
while True:
    save_checkpoint(sys.argv[1], epoch, {"param.0": torch.full((4_000_000,), float(epoch))}, {}, keep=1)
    epoch += 1
"""


def test_kill_9_during_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1.0), {}, keep=1)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    # Kill once a temporary folder exists, i.e. in the middle of a write.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert time.monotonic() < deadline, "the writer never started a checkpoint"
    ck = load_latest(tmp_path)
    assert ck is not None
    value = float(ck.tensors["param.0"][0])
    assert value == float(ck.epoch)
    # A later save cleans the stray temporary folder.
    save_checkpoint(tmp_path, 999, _tensors(9.0), {}, keep=1)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="needs root to mount a small tmpfs that can fill up")
def test_disk_full_is_a_clear_error_and_previous_is_untouched(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        save_checkpoint(mnt, 1, _tensors(1.0, 1000), {})
        with pytest.raises(CheckpointError, match="disk full"):
            save_checkpoint(mnt, 2, _tensors(2.0, 1_000_000), {})
        ck = load_latest(mnt)
        assert ck is not None and ck.epoch == 1 and float(ck.tensors["param.0"][0]) == 1.0
        assert not any(p.name.startswith(".tmp-") for p in mnt.iterdir())
        del ck  # safetensors maps the file: holding it keeps the tmpfs busy
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mnt)], check=False)  # detached now, freed once unused


BACKGROUND_WRITER = r"""
import sys, torch
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.resume import save_session
from p2p_diloco.peer.session import SwarmSession
cfg = PeerConfig()
cfg.run.checkpoint_dir, cfg.run.keep_checkpoints = sys.argv[1], 2
params = [torch.nn.Parameter(torch.zeros(2_000_000)), torch.nn.Parameter(torch.zeros(300, 300))]
session = SwarmSession(cfg, params, "abcdef0123456789")  # nothing network starts before start()
print("ready", flush=True)
for epoch in range(1, 10_000):
    session.port.serving.wait_writer()          # what the next outer step does before it changes the anchors
    for a in session.state.anchors:
        a.fill_(float(epoch))           # every value of a checkpoint names its epoch
    session.state.epoch = epoch
    save_session(session, lambda e, s: print("saved", e, flush=True))
"""


def test_a_background_checkpoint_is_complete_or_absent_after_a_kill(tmp_path: Path) -> None:
    """Checkpoints written back to back by the background writer from the live anchors, killed -9 (most likely
    in the middle of a write): what loads is one complete, consistent epoch (every anchor value equals it)."""
    saves_before_kill = 3
    proc = subprocess.Popen([sys.executable, "-c", BACKGROUND_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(saves_before_kill):
            assert proc.stdout.readline().startswith("saved")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    ck = load_latest(tmp_path)
    if ck is None:
        assert saves_before_kill == 0
        return
    assert ck.epoch >= saves_before_kill
    for key in ("param.0", "param.1"):
        assert torch.all(ck.tensors[key] == float(ck.epoch)), key
