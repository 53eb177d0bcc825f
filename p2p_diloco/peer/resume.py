"""A session's checkpoints: :meth:`SwarmSession.state_dict` on disk (safetensors + a JSON manifest) and back.

The manifest names the run and model the state belongs to, so a checkpoint is never resumed into another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2p_diloco.checkpoint import Checkpoint, CheckpointError, save_checkpoint
from p2p_diloco.peer.session import SwarmSession

if TYPE_CHECKING:
    from p2p_diloco.peer.node_session import NodeSession

logger = logging.getLogger(__name__)


def state_dict_of(ck: Checkpoint) -> dict[str, Any]:
    """A checkpoint as :meth:`SwarmSession.load_state_dict` takes it."""
    return {"epoch": ck.epoch, "outer": ck.tensors, "inner_step": ck.manifest.get("inner_step", 0),
            "data_id": ck.manifest.get("data_id"), "data_position": ck.manifest.get("data_position", {}),
            "node_data_positions": ck.manifest.get("node_data_positions", []),
            "fragment_epochs": ck.manifest.get("fragment_epochs")}


def save_session(session: SwarmSession | NodeSession, on_saved: Callable[[int, float], None] | None = None) -> None:
    """Write the session's state to ``--checkpoint-dir`` (keeping ``--keep-checkpoints``) on a background
    thread, straight from the live anchors and momentum (``SwarmSession.save_in_background``: no host copy,
    and the next outer step waits for the write). ``on_saved(epoch, seconds)`` runs on that thread once the
    checkpoint is complete on disk. A failure is logged; training goes on and the previous checkpoint stays.
    The write is atomic (``checkpoint.save_checkpoint``): a kill at any moment leaves it complete or absent.

    A node's session: every rank calls this (it gathers the ranks' data positions); rank 0 writes, with the
    other ranks' positions in the manifest."""
    cfg = session.cfg

    def write(state: dict[str, Any]) -> None:
        began = time.monotonic()
        manifest = {"run_id": cfg.run.run_id, "fingerprint": session.fingerprint, "model": cfg.model.model,
                    "seq_len": cfg.model.seq_len, "data_id": state["data_id"],
                    "data_position": state["data_position"], "inner_step": state["inner_step"],
                    "saved_at": time.time()}
        if state.get("fragment_epochs") is not None:  # a Streaming DiLoCo peer's (peer.streaming_session)
            manifest["fragment_epochs"] = state["fragment_epochs"]
        if state.get("node_data_positions"):
            manifest["node_data_positions"] = state["node_data_positions"]
        try:
            save_checkpoint(cfg.run.checkpoint_dir, state["epoch"], state["outer"], manifest,
                            keep=cfg.run.keep_checkpoints)
        except CheckpointError as e:
            logger.error("%s", e)
            return
        except Exception:  # noqa: BLE001 - a background write must never take the peer down
            logger.exception("Checkpoint of epoch %d failed", state["epoch"])
            return
        if on_saved is not None:
            try:
                on_saved(state["epoch"], time.monotonic() - began)
            except Exception:  # noqa: BLE001
                logger.exception("on_saved failed")

    session.save_in_background(write)
