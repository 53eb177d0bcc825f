"""Causal language models: Llama presets built from scratch, or any Hugging Face causal LM.

Presets use transformers' ``LlamaConfig`` + ``LlamaForCausalLM`` so that the code every peer runs is the
maintained reference implementation, not a copy. Parameter counts below are with the byte tokenizer
(vocabulary 259); with a 32k vocabulary the embedding adds 32000 x hidden_size.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    note: str


PRESETS: dict[str, Preset] = {
    # ~0.84M parameters: trains on a laptop CPU in minutes; tests and the demo use it.
    "tiny": Preset(128, 352, 4, 4, "about 1M parameters, for tests and CPU demos"),
    # ~4.9M parameters: between tiny and small, for longer simulator runs that stay on a CPU.
    "mini": Preset(256, 704, 6, 4, "about 5M parameters, for longer CPU simulations"),
    # ~21M parameters: the Async Local-SGD paper's smallest model size.
    "small": Preset(384, 1024, 12, 6, "about 20M parameters (the Async Local-SGD paper's smallest)"),
    # ~117M with bytes, ~146M with a 32k vocabulary: the DiLoCo paper's main size (its 150M counts a 32k
    # vocabulary's embedding; the byte tokenizer's is 259 x 896).
    "150m": Preset(896, 2432, 12, 14, "about 117M parameters with bytes, 146M with a 32k vocabulary (the DiLoCo paper's size)"),
}


class ModelLoadError(RuntimeError):
    """The model named by the user cannot be built or loaded; the message says why and what to do."""


def preset_config(name: str, vocab_size: int, seq_len: int) -> LlamaConfig:
    p = PRESETS[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_attention_heads,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
    )


def build_model(name: str, vocab_size: int, seq_len: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Build a preset from scratch (same ``seed`` gives the same weights on every peer) or load ``name``.

    ``dtype`` is what a pretrained model is loaded in (``--weights-dtype``: bf16 halves the host memory
    the load takes); presets are built in fp32 and cast where they train. Code shipped with a hub model is
    never run (``trust_remote_code=False``): only architectures transformers itself implements load.

    Every peer of a run must start from identical parameters; presets guarantee it through the seed, a
    pretrained model through its checkpoint. The swarm verifies it anyway with a checksum.
    """
    if name in PRESETS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(preset_config(name, vocab_size, seq_len))
        return model
    try:
        AutoConfig.from_pretrained(name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"cannot load model {name!r}: {first}. Use a preset ({', '.join(PRESETS)}), a local folder "
            "with config.json and weights, or a hub id while online (HF_HUB_OFFLINE must not be set)"
        ) from None
    if model.get_input_embeddings().num_embeddings < vocab_size:
        model.resize_token_embeddings(vocab_size)
    return model


def model_fingerprint(model: PreTrainedModel, model_name: str) -> str:
    """A short hash of the architecture (names, shapes, dtypes): peers refuse to average on a mismatch."""
    spec = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    blob = json.dumps({"model": model_name, "params": spec}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
