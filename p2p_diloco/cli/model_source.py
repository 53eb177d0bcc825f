"""Where ``run_peer export`` and ``run_peer eval`` take the model's parameters from.

Both take the flags of ``run_peer`` (same parser, same config file, same environment), so the command that
trained a peer, with ``export`` or ``eval`` in front, names the run's model, tokenizer, checkpoints and
swarm. ``--source`` picks the parameters:

- ``checkpoint``: the newest complete checkpoint in ``--checkpoint-dir`` (or that one ``ckpt-*`` folder),
  checked against the model the flags build (same fingerprint as the run's, or a usage error);
- ``swarm``: the swarm's current state, downloaded and verified exactly as a joiner does
  (:func:`p2p_diloco.swarm.download_state`: the donors' metadata, shapes, finiteness, claimed sha256 and
  the peers' majority checksum), without training, averaging or serving anything;
- ``model``: the model as ``--model`` builds it: a preset's initialisation, or a Hugging Face folder (an
  exported one, for instance) as ``from_pretrained`` loads it;
- ``auto`` (the default): ``checkpoint`` when ``--checkpoint-dir`` is given, else ``swarm`` when
  ``--initial-peers`` is, else ``model``.

Reading the swarm starts a DHT node of its own: with the peer's config file, the peer's ``identity_path``
would collide with the running peer (hivemind refuses a taken identity), so leave it out and a fresh id is
made. A private swarm (``--allowed-peers``) serves its state only to listed ids: list the one you export
with, and pass its key as ``--identity-path``.

Memory, at 1B parameters: the model (4 GB in float32) plus the checkpoint's tensors or the downloaded state
(parameters and outer momentum, 8 GB), on the CPU; the momentum is dropped as soon as it is checked.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from p2p_diloco.build import build_model_and_tokenizer
from p2p_diloco.checkpoint import MANIFEST, CheckpointError, load_checkpoint, load_latest
from p2p_diloco.core.evidence import Claim, Evidence
from p2p_diloco.data.tokenizer import Tokenizer
from p2p_diloco.models import ModelLoadError, model_fingerprint
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.swarm import (
    RoundAverager,
    SwarmStartError,
    download_state,
    fetch_progress,
    params_sha256,
    run_validator,
    start_dht,
)
from p2p_diloco.swarm.config import read_allowed_peers

logger = logging.getLogger(__name__)

INFO_FILE = "p2p_diloco.json"
"""Written by ``run_peer export`` beside the weights: the run, epoch and sha256 the parameters came from."""
SOURCES = ("auto", "checkpoint", "swarm", "model")
RETRY_S = 3.0
"""Pause between state-download attempts while no donor has the swarm's state yet."""


class SourceError(RuntimeError):
    """The parameters cannot be had from the chosen source; the message says why and what to do.

    ``usage`` marks the user's mistake (exit code 2) as opposed to a swarm that did not answer (exit 1).
    """

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass
class LoadedModel:
    """A model holding the chosen parameters, with where they came from."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    source: str
    """'checkpoint', 'swarm' or 'model'."""
    origin: str
    """Human-readable origin: the checkpoint folder, the donor peer, or the model name."""
    epoch: int | None
    """The outer epoch of the parameters (None for ``model``: a folder does not record one)."""
    params_sha256: str
    """The sha256 of the parameters as the swarm computes it (``swarm.params_sha256``)."""
    fingerprint: str


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=SOURCES, default="auto",
                        help="where the parameters come from: the newest checkpoint in --checkpoint-dir, the "
                             "live swarm reached through --initial-peers (downloaded and verified as a joiner "
                             "does, without training), or the model --model builds (a Hugging Face folder); "
                             "auto picks checkpoint, then swarm, then model from the flags given")


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers' loading and saving: these commands print one result line."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def resolve_source(choice: str, cfg: PeerConfig) -> str:
    if choice != "auto":
        return choice
    if cfg.run.checkpoint_dir:
        return "checkpoint"
    if cfg.swarm.initial_peers:
        return "swarm"
    return "model"


def load_model(cfg: PeerConfig, choice: str) -> LoadedModel:
    """Build the run's model from ``cfg`` and put the parameters of ``choice`` into it (on the CPU)."""
    source = resolve_source(choice, cfg)
    try:
        tokenizer, model = build_model_and_tokenizer(cfg)
    except (ModelLoadError, ValueError) as e:
        raise SourceError(str(e)) from None
    fingerprint = model_fingerprint(model, cfg.model.model)
    params = list(model.parameters())
    if source == "checkpoint":
        epoch, origin = _from_checkpoint(cfg, fingerprint, params)
    elif source == "swarm":
        epoch, origin = _from_swarm(cfg, fingerprint, params)
    else:
        epoch, origin = _exported_epoch(cfg.model.model), cfg.model.model
    model.eval()
    return LoadedModel(model, tokenizer, source, origin, epoch, params_sha256([p.detach() for p in params]),
                       fingerprint)


def _exported_epoch(model: str) -> int | None:
    """The epoch an exported folder records in its ``p2p_diloco.json`` (None for anything else)."""
    try:
        info = json.loads((Path(model).expanduser() / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    epoch = info.get("epoch") if isinstance(info, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


@torch.no_grad()
def _copy_into(params: list[torch.nn.Parameter], tensors: list[torch.Tensor], where: str) -> None:
    if len(tensors) != len(params):
        raise SourceError(f"{where} holds {len(tensors)} parameter tensors, the model {len(params)}; "
                          "pass the run's --model, --seq-len and --tokenizer")
    for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
        if tuple(p.shape) != tuple(t.shape):
            raise SourceError(f"{where}: parameter {i} is {tuple(t.shape)}, the model's {tuple(p.shape)}; "
                              "pass the run's --model, --seq-len and --tokenizer")
        p.copy_(t)


def _from_checkpoint(cfg: PeerConfig, fingerprint: str, params: list[torch.nn.Parameter]) -> tuple[int, str]:
    if not cfg.run.checkpoint_dir:
        raise SourceError("--source checkpoint needs --checkpoint-dir DIR (the folder run_peer saved into, or "
                          "one ckpt-* folder in it)")
    path = Path(cfg.run.checkpoint_dir).expanduser()
    try:
        ck = load_checkpoint(path) if (path / MANIFEST).is_file() else load_latest(path)
    except CheckpointError as e:
        raise SourceError(str(e)) from None
    if ck is None:
        raise SourceError(f"no complete checkpoint in {str(path)!r}; pass the --checkpoint-dir a peer saved into")
    if ck.manifest.get("fingerprint") != fingerprint:
        raise SourceError(
            f"checkpoint {ck.path} holds model {ck.manifest.get('model')!r} with fingerprint "
            f"{ck.manifest.get('fingerprint')!r}; the flags build {cfg.model.model!r} with {fingerprint!r}. "
            "Pass the run's --model, --seq-len and --tokenizer")
    keys = [k for k in ck.tensors if k.startswith("param.")]
    try:
        tensors = [ck.tensors[f"param.{i}"] for i in range(len(keys))]
    except KeyError:
        raise SourceError(f"checkpoint {ck.path}: parameter tensors are not numbered param.0..param.N") from None
    _copy_into(params, tensors, f"checkpoint {ck.path}")
    return ck.epoch, str(ck.path)


def _from_swarm(cfg: PeerConfig, fingerprint: str, params: list[torch.nn.Parameter]) -> tuple[int, str]:
    """Join the DHT, download the verified state (waiting up to state_download_timeout_s for a donor), leave.

    Nothing is published: no progress record (peers do not count this node as a member), no checksum, no
    state of our own, and no matchmaking, so the swarm's rounds do not notice it.
    """
    if not cfg.swarm.initial_peers:
        raise SourceError("--source swarm needs --initial-peers (the run's bootstrap addresses)")
    try:
        dht = start_dht(cfg.swarm, record_validators=[run_validator(cfg.swarm.run_id)])
    except SwarmStartError as e:
        raise SourceError(str(e), usage=False) from None
    averager = None
    try:
        # This node never averages, so its averaging buffers hold one scalar, not the model: at 1B parameters
        # a model-shaped template would cost 8 GB of shared memory for nothing. Downloads check the state
        # against the templates given to download_state, not against these.
        averager = RoundAverager([torch.zeros(1)], dht, cfg.swarm, fingerprint=fingerprint)
        templates = [p.detach() for p in params]
        # Donors always send their outer momentum; only its shapes and dtypes are checked, so the template
        # is a zero-byte view, and the received momentum is dropped right away.
        opt = [torch.empty((), dtype=t.dtype).expand(t.shape) for t in templates]
        deadline = time.monotonic() + cfg.swarm.state_download_timeout_s
        # Which epoch to ask for, and which donors and checksums to believe, as a joining peer decides
        # (core.evidence): one record claiming a huge epoch must not make every download "too old".
        trusted = read_allowed_peers(cfg.swarm.trusted_peers, "trusted_peers") if cfg.swarm.trusted_peers else ()
        evidence = Evidence(dht.peer_id.to_base58(), trusted)
        while True:
            remaining = deadline - time.monotonic()
            try:
                records = fetch_progress(dht, cfg.swarm.run_id)
            except Exception as e:  # noqa: BLE001 - a lookup that timed out: ask any donor
                logger.warning("Could not read the swarm's progress records: %r", e)
                records = []
            claims = [Claim(r.peer_id, r.epoch) for r in records
                      if r.fingerprint == fingerprint and not r.client_mode]
            min_epoch = evidence.swarm_epoch(claims) or 0
            state = download_state(averager, templates, opt, timeout=max(1.0, remaining), min_epoch=min_epoch,
                                   trusted=evidence.trusted_or_none(c.peer_id for c in claims))
            if state is not None or remaining <= RETRY_S:
                break
            evidence.unbacked(claims, min_epoch)
            logger.info("No peer shared an acceptable state of epoch %d yet; retrying for %.0f s more",
                        min_epoch, remaining)
            time.sleep(RETRY_S)
        if state is None:
            raise SourceError(
                f"no peer of run {cfg.swarm.run_id!r} (model {cfg.model.model}, fingerprint {fingerprint}) shared "
                f"a verified state within {cfg.swarm.state_download_timeout_s:g} s. Check --run-id, --model, "
                "--seq-len, --tokenizer and --initial-peers, or raise --state-download-timeout-s", usage=False)
        _copy_into(params, state.params, f"the state of {state.donor}")
        del state.opt_tensors[:]
        return state.epoch, f"peer {state.donor}"
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
