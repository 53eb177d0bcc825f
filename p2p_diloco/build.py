"""Assemble a peer's local training pieces (tokenizer, model, data, trainer) from a :class:`TrainConfig`.

The simulator, ``run_peer`` and the preflight all build through here, so a flag means the same thing
everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from p2p_diloco.config import TrainConfig
from p2p_diloco.data.loader import DataPosition, PeerTokenStream, eval_batches
from p2p_diloco.data.sources import open_text_dataset
from p2p_diloco.data.tokenizer import Tokenizer, load_tokenizer
from p2p_diloco.models import PRESETS, build_model, model_fingerprint
from p2p_diloco.trainer import InnerTrainer

logger = logging.getLogger(__name__)


@dataclass
class LocalSetup:
    """What a peer trains with; the swarm layer gets only ``trainer.parameters()``."""

    cfg: TrainConfig
    tokenizer: Tokenizer
    model: PreTrainedModel
    stream: PeerTokenStream
    trainer: InnerTrainer
    eval_batches: list[torch.Tensor]
    fingerprint: str


def build_model_and_tokenizer(cfg: TrainConfig) -> tuple[Tokenizer, PreTrainedModel]:
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.model, tuple(PRESETS))
    dtype = torch.bfloat16 if cfg.inner.weights_dtype == "bf16" else torch.float32
    model = build_model(cfg.model.model, tokenizer.vocab_size, cfg.model.seq_len, seed=cfg.run.seed, dtype=dtype)
    return tokenizer, model


def held_out_batches(cfg: TrainConfig, tokenizer: Tokenizer) -> list[torch.Tensor]:
    """The evaluation batches of the held-out split: the same on every peer and in ``run_peer eval``."""
    held_out = open_text_dataset(cfg.data.dataset, "eval", cfg.data.text_field, cfg.data.dataset_config)
    return eval_batches(
        held_out, tokenizer, cfg.model.seq_len, cfg.inner.micro_batch, cfg.data.eval_batches, cfg.data.text_field
    )


def build_local(cfg: TrainConfig, peer_id: str, position: DataPosition | None = None,
                parts: tuple[Tokenizer, PreTrainedModel] | None = None) -> LocalSetup:
    """Everything a peer trains with. ``peer_id`` picks its data shard; ``parts`` reuses a built model (on a
    multi-GPU node, the rank's DDP wrapper or FSDP2-sharded model: the trainer trains what it is given)."""
    tokenizer, model = parts or build_model_and_tokenizer(cfg)
    train = open_text_dataset(cfg.data.dataset, "train", cfg.data.text_field, cfg.data.dataset_config)
    stream = PeerTokenStream(
        train, tokenizer, cfg.model.seq_len, cfg.inner.batch_size, peer_id,
        text_field=cfg.data.text_field, num_shards=cfg.data.virtual_shards, seed=cfg.run.seed,
        position=position,
    )
    # 0 disables evaluation: no held-out split is read, whatever its size
    evals = held_out_batches(cfg, tokenizer) if cfg.run.eval_every else []
    trainer = InnerTrainer(model, cfg.inner, stream)
    inner = getattr(model, "module", model)  # a DDP wrapper names its parameters module.*
    return LocalSetup(cfg, tokenizer, model, stream, trainer, evals, model_fingerprint(inner, cfg.model.model))
