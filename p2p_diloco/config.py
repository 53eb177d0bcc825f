"""The configuration of a training peer, as dataclasses.

Each field carries its documentation right under it; :mod:`p2p_diloco.config_loader` turns the same
fields into CLI flags, environment variables and config-file keys. Validation lives in ``__post_init__``
and raises ``ValueError("field: what is wrong; what is allowed")``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from p2p_diloco.core.codecs import CODEC_NAMES, CodecName
from p2p_diloco.core.outer_defaults import OuterChoice, choose_outer
from p2p_diloco.core.sparse import SPARSE_CODEC_NAMES

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""The one run-id rule, for every place that names or reads a run (this config, ``SwarmConfig``, the group
metadata a peer receives, the bootstrap's monitored runs): 1-64 letters, digits, '_' or '-', starting with a
letter or digit (so that a run id never reads as a flag). Match with :func:`is_run_id` (a full match)."""
SPARSE_ERROR_FEEDBACK_DECAY = 0.95
"""``OuterConfig.error_feedback_decay``'s default with a sparse codec: the published SparseLoCo setting, and a
bound on how far an honest residual can grow while replies drop its values (about 1 / (1 - 0.95) rounds)."""
RUN_ID_RULE = "1-64 letters, digits, '_' or '-', starting with a letter or digit"
""":data:`RUN_ID_PATTERN` in words, for error messages."""


def is_run_id(value: object) -> bool:
    """Whether ``value`` is a valid run id (:data:`RUN_ID_PATTERN`, matched whole: no trailing newline)."""
    return isinstance(value, str) and RUN_ID_PATTERN.fullmatch(value) is not None


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = (low < value if low_open else low <= value) and value <= high and math.isfinite(value)
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}: must be in {bracket}{low}, {high}], got {value}")


@dataclass
class ModelConfig:
    """Which model every peer of the run trains."""

    model: str = "tiny"
    """A preset (tiny ~0.84M params, mini ~4.9M, small ~21M, 150m ~117M with the byte tokenizer, ~146M with a 32k
    vocabulary; Llama architecture) or a Hugging Face causal-LM
    id or local path. Presets are built from scratch; a name or path is loaded with from_pretrained."""

    seq_len: int = 128
    """Tokens per training sequence. Longer sequences cost memory quadratically in attention; 128 suits the
    tiny preset on CPU, 512-2048 suit GPUs."""

    def __post_init__(self) -> None:
        if not self.model or not self.model.strip():
            raise ValueError("model: must name a preset (tiny, mini, small, 150m) or a Hugging Face model")
        if not 8 <= self.seq_len <= 65536:
            raise ValueError(f"seq_len: must be in [8, 65536], got {self.seq_len}")


@dataclass
class DataConfig:
    """Where training text comes from and how it is tokenized."""

    dataset: str = "embedded"
    """'embedded' (the synthetic corpus shipped with the package, no network), a local .txt/.jsonl/.json/
    .parquet file or a folder of them (kinds may be mixed), or 'hf:NAME' for a Hugging Face dataset streamed from the hub."""

    dataset_config: str | None = None
    """Configuration name of a hub dataset (e.g. 'en' for allenai/c4); ignored for other sources."""

    text_field: str = "text"
    """Column holding the text in jsonl/parquet files and hub datasets."""

    tokenizer: str | None = None
    """'byte' (no download) or a Hugging Face tokenizer id/path. Default: 'byte' for presets, the model's
    own tokenizer for a Hugging Face model."""

    virtual_shards: int = 256
    """How many slices the data is cut into for peers to walk. Each peer starts at a slice derived from its
    peer id; two peers overlap only when one walk reaches the other's start, so set this well above the
    number of peers you expect (the default suits up to ~50)."""

    eval_batches: int = 8
    """Batches of the held-out split per evaluation. More batches give a less noisy eval loss."""

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ValueError("dataset: must be 'embedded', a local file/folder, or 'hf:NAME'")
        if not 1 <= self.virtual_shards <= 1_000_000:
            raise ValueError(f"virtual_shards: must be in [1, 1000000], got {self.virtual_shards}")
        if not 1 <= self.eval_batches <= 10_000:
            raise ValueError(f"eval_batches: must be in [1, 10000], got {self.eval_batches}")


@dataclass
class InnerConfig:
    """The local (inner) optimizer each peer runs between averaging rounds."""

    batch_size: int = 16
    """Sequences per inner optimizer step on this peer. Reached with gradient accumulation when
    micro_batch_size is smaller."""

    micro_batch_size: int | None = None
    """Sequences per forward/backward pass (must divide batch_size; default: batch_size); lower it when the
    batch does not fit in memory, and gradient accumulation keeps the results the same."""

    lr: float = field(default=4e-4, metadata={"flag": "inner-lr"})
    """Peak AdamW learning rate. The DiLoCo paper uses 4e-4 for 150M models; tiny models tolerate 1e-3."""

    warmup_steps: int = 1000
    """Linear warmup steps before the cosine decay (the DiLoCo paper uses 1000)."""

    total_steps: int = 0
    """Inner steps over which the learning rate decays by cosine to min_lr_ratio x lr. 0: derive from
    max_rounds x local_steps (/ fragments) when max_rounds is set, else keep the peak after warmup."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay (the DiLoCo paper uses 0.1)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""

    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' uses bf16 autocast on CUDA devices that support it and fp32 elsewhere."""

    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them, for about a third more
    compute per step. Turn it on when ``run_peer doctor`` says the activations do not fit
    (peers/README.md#memory-weights-dtype-and-activations)."""

    weights_dtype: Literal["fp32", "bf16"] = "fp32"
    """How the training device stores weights, gradients and AdamW moments: 'fp32' (16 bytes per parameter) or
    'bf16' (CUDA only, 8 bytes, but AdamW then rounds away updates below about 2^-8 of a weight). Prefer fp32
    when the model fits (peers/README.md#memory-weights-dtype-and-activations)."""

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 65536:
            raise ValueError(f"batch_size: must be in [1, 65536], got {self.batch_size}")
        if self.micro_batch_size is not None and (
            self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size
        ):
            raise ValueError(
                f"micro_batch_size: must be >= 1 and divide batch_size={self.batch_size}, "
                f"got {self.micro_batch_size}"
            )
        _check_range("lr", self.lr, 0.0, 1.0, low_open=True)
        if not 0 <= self.warmup_steps <= 10_000_000:
            raise ValueError(f"warmup_steps: must be in [0, 10000000], got {self.warmup_steps}")
        if self.total_steps < 0:
            raise ValueError(f"total_steps: must be >= 0, got {self.total_steps}")
        _check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_range("weight_decay", self.weight_decay, 0.0, 10.0)
        _check_range("grad_clip", self.grad_clip, 0.0, 1e6)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"device: must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision: must be auto, fp32 or bf16, got {self.precision!r}")
        if self.weights_dtype not in ("fp32", "bf16"):
            raise ValueError(f"weights_dtype: must be fp32 or bf16, got {self.weights_dtype!r}")

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size or self.batch_size


@dataclass
class OuterConfig:
    """The outer optimizer and the round structure shared by the swarm."""

    local_steps: int = 500
    """Inner steps per round for the fastest peer (H; slower peers run fewer): pick H so a round takes well
    over the all-reduce time (about 10x with overlap 'none', 1x with 'eager'). The DiLoCo paper uses 500; H
    also decides the outer lr and momentum (peers/README.md#round-length-outer-lr-and-momentum)."""

    lr: float | None = field(default=None, metadata={"flag": "outer-lr"})
    """Outer learning rate η; unset (the default), chosen from H, ``expected_peers`` and ``overlap`` and
    stated in the log at start (1 below H = 100, 0.7 with eager; else 0.4 for one peer, 0.6 for 2-7, 0.7 from
    8). With tens of rounds η = 1 without momentum did best, with hundreds the paper's 0.7 / 0.9
    (peers/README.md#round-length-outer-lr-and-momentum)."""

    momentum: float | None = field(default=None, metadata={"flag": "outer-momentum"})
    """Outer Nesterov momentum μ; unset (the default), 0 below H = 100 and 0.9 from H = 100 on, stated in the
    log at start. It pays off only over many rounds; when you change it keep lr / (1 − μ) about the same and
    lr at most 1 (peers/README.md#round-length-outer-lr-and-momentum)."""

    expected_peers: int = 8
    """About how many peers you expect in a round (k), used only to choose ``lr`` when it is not given (0.4
    for 1, 0.6 for 2-7, 0.7 from 8 at H >= 100; the default 8 is the DiLoCo paper's k). Peers of one run
    should state the same number, since every peer steps with its own outer settings."""

    choice: OuterChoice | None = field(default=None, init=False, repr=False, metadata={"cli": False})
    """How ``lr`` and ``momentum`` were chosen (filled in by validation; the peer logs it at start)."""

    min_local_steps: int = 5
    """Floor on a slow peer's DyLU step count, so that its contribution is worth the round trip."""

    compression: CodecName = "none"
    """Codec for pseudo-gradients on the wire: fp16 halves the bytes, int8 quarters them, 4bit sends about
    1/8, 2bit 1/14 and topk about 1/140 (2bit and topk need ``error_feedback``). Keep 'none' (exact) while
    rounds fit, then try 4bit first (peers/README.md#a-slow-uplink-what-each-codec-costs)."""

    topk_chunk_size: int = 4096
    """Values per chunk for the sparse codecs (a power of two, 16-32768): top-k is taken per chunk, so every
    region of the model gets ``topk_k / topk_chunk_size`` of the bandwidth. 4096 is the published setting;
    smaller chunks spread the bandwidth more evenly, larger ones let the largest values of a region win."""

    topk_k: int = 64
    """Values kept per chunk by the sparse codecs (1..chunk size): the bytes grow about linearly with it
    (64 of 4096 = 1.56%: 117 bytes per chunk, 1/140 of fp32). With error feedback a smaller k delays values
    rather than losing them; lower it when the uplink is the bottleneck, raise it if the loss suffers."""

    error_feedback: bool = False
    """Keep what lossy compression dropped and add it to the next round's pseudo-gradient: needed with 2bit
    and the sparse codecs, a small help to 4bit. It costs one more model-sized fp32 buffer in host memory (the
    averager process) for the whole run."""

    error_feedback_decay: float | None = None
    """Factor on the carried error before the next round, 0-1; unset: 0.95 with the sparse codecs (the
    published SparseLoCo setting), 1 with the dense ones. With a sparse codec lower it (0.8-0.9) for few, long
    rounds; 0 drops the error each round (peers/README.md#codecs-top-k-and-error-feedback)."""

    credit_undelivered: bool = True
    """With a sparse codec and ``error_feedback``: put back into the residual every entry the reducers' top-k
    reply dropped, so it is delayed instead of lost (no bytes; parameters stay identical). Turn it off only to
    measure or reproduce a run without it (peers/README.md#codecs-top-k-and-error-feedback)."""

    overlap: Literal["none", "eager"] = "none"
    """'none' waits for each round's all-reduce; 'eager' runs it in the background during the next round, with
    the others' term one round old. Pick eager when the all-reduce is a noticeable share of a round; every
    peer of a run must use the same mode (peers/README.md#overlap-eager-rounds)."""

    fragments: int = 1
    """Streaming DiLoCo: split the model into F fragments that synchronise at staggered steps, so a peer's
    peak bandwidth drops about F-fold (1 is plain DiLoCo; F at most the layer count and H). Pick F so that a
    fragment's all-reduce fits the link (peers/README.md#10-fragments-streaming-diloco)."""

    fragment_delay: int = 0
    """τ, the inner steps a fragment's all-reduce overlaps training before its result is merged (0 blocks; at
    most H / F), which spreads its bytes and lowers the peak further at the price of local work the merge
    partly overwrites. In the swarm choose about H / 2F (peers/README.md#10-fragments-streaming-diloco)."""

    fragment_alpha: float = 0.0
    """α in [0, 1), how a fragment's outer result merges with the local copy: params ← α·local + (1 −
    α)·global, so 0 takes the global result (DiLoCo with τ = 0). Check α > 0 at your run length with the
    simulator (peers/README.md#10-fragments-streaming-diloco)."""

    max_staleness: int = 4
    """Late work older than this many rounds is dropped instead of folded in."""

    staleness_decay: float = 1.0
    """Late work of staleness s is weighted by staleness_decay**(s-1); 1.0 treats it as the paper's DN."""

    def __post_init__(self) -> None:
        if not 1 <= self.local_steps <= 1_000_000:
            raise ValueError(f"local_steps: must be in [1, 1000000], got {self.local_steps}")
        if not 1 <= self.expected_peers <= 100_000:
            raise ValueError(f"expected_peers: must be in [1, 100000], got {self.expected_peers}")
        if self.lr is not None:
            _check_range("lr", self.lr, 0.0, 10.0, low_open=True)
        if self.momentum is not None:
            _check_range("momentum", self.momentum, 0.0, 0.999)
        self.choice = choose_outer(self.local_steps, self.expected_peers, self.overlap, self.lr, self.momentum)
        self.lr, self.momentum = self.choice.lr, self.choice.momentum
        if not 1 <= self.min_local_steps <= self.local_steps:
            raise ValueError(
                f"min_local_steps: must be in [1, local_steps={self.local_steps}], got {self.min_local_steps}"
            )
        if self.compression not in CODEC_NAMES:
            raise ValueError(f"compression: must be one of {', '.join(CODEC_NAMES)}, got {self.compression!r}")
        if not (16 <= self.topk_chunk_size <= 32768 and self.topk_chunk_size & (self.topk_chunk_size - 1) == 0):
            raise ValueError(f"topk_chunk_size: must be a power of two in [16, 32768], got {self.topk_chunk_size}")
        if not 1 <= self.topk_k <= self.topk_chunk_size:
            raise ValueError(f"topk_k: must be in [1, topk_chunk_size={self.topk_chunk_size}], got {self.topk_k}")
        if self.error_feedback_decay is None:
            self.error_feedback_decay = (SPARSE_ERROR_FEEDBACK_DECAY if self.compression in SPARSE_CODEC_NAMES
                                         else 1.0)
        _check_range("error_feedback_decay", self.error_feedback_decay, 0.0, 1.0)
        if not isinstance(self.credit_undelivered, bool):
            raise ValueError(f"credit_undelivered: must be true or false, got {self.credit_undelivered!r}")
        if self.overlap not in ("none", "eager"):
            raise ValueError(f"overlap: must be 'none' or 'eager', got {self.overlap!r}")
        if not 1 <= self.fragments <= 64:
            raise ValueError(f"fragments: must be in [1, 64], got {self.fragments}")
        if self.fragments > self.local_steps:
            raise ValueError(f"fragments: at most local_steps={self.local_steps} (each fragment syncs at its own "
                             f"step), got {self.fragments}")
        if not 0 <= self.fragment_delay <= self.local_steps // self.fragments:
            raise ValueError(f"fragment_delay: must be in [0, local_steps / fragments = "
                             f"{self.local_steps // self.fragments}] so one fragment's all-reduce ends before the "
                             f"next one's starts, got {self.fragment_delay}")
        _check_range("fragment_alpha", self.fragment_alpha, 0.0, 0.999)
        if self.fragments > 1 and self.overlap != "none":
            raise ValueError("fragments: Streaming DiLoCo overlaps through --fragment-delay; use it with "
                             "--overlap none")
        if not 0 <= self.max_staleness <= 1000:
            raise ValueError(f"max_staleness: must be in [0, 1000], got {self.max_staleness}")
        _check_range("staleness_decay", self.staleness_decay, 0.0, 1.0)


@dataclass
class RunConfig:
    """Identity of the run and what this peer keeps on disk."""

    run_id: str = "p2p-diloco-demo"
    """Name shared by every peer of one training run; peers with another run id are never averaged with.
    Letters, digits, '_' and '-', at most 64 characters."""

    seed: int = 0
    """Seed for model initialisation (shared by the run) and local data order (mixed with the peer id)."""

    max_rounds: int = 0
    """Stop after this many rounds; 0 runs until interrupted. With ``--fragments F`` every fragment's round
    counts (F rounds per H inner steps), as it does for ``eval_every`` and ``checkpoint_every``: set F times
    the number of outer rounds you want."""

    checkpoint_dir: str | None = None
    """Folder for checkpoints (safetensors + JSON manifest). Default: no checkpoints."""

    checkpoint_every: int = 5
    """Save a checkpoint every this many rounds, in the background from the live outer state (8 bytes per
    parameter). The default 5 bounds what a lost machine costs to about an hour at H = 500; use 1 for short
    runs and tests (peers/README.md#evaluation-and-checkpoints)."""

    keep_checkpoints: int = 3
    """How many complete checkpoints to keep; older ones are deleted after a new one is written."""

    resume: bool = False
    """Continue from the newest complete checkpoint in checkpoint_dir; damaged ones are skipped for the next
    newest, and one of another run, model or seq_len is refused. When every checkpoint is damaged the peer
    stops, unless ``start_fresh`` is set (peers/README.md#6-stop-and-resume)."""

    start_fresh: bool = False
    """With resume: when every checkpoint in checkpoint_dir is damaged, start without one instead of stopping.
    The damaged ones are kept, renamed damaged-ckpt-*, so no later save overwrites them."""

    log_file: str | None = None
    """Write one JSON line per event (round, eval, ...) to this file."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0.0.0.0). Default: no metrics endpoint."""

    eval_every: int | None = None
    """Evaluate on the held-out split at start, every this many rounds and after the last; 0 disables it.
    Unset (the default): the fewest rounds keeping its cost under about 3% of the inner steps; 1 follows the
    eval loss round by round (peers/README.md#evaluation-and-checkpoints)."""

    def __post_init__(self) -> None:
        if not is_run_id(self.run_id):
            raise ValueError(f"run_id: use {RUN_ID_RULE}, got {self.run_id!r}")
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds: must be >= 0, got {self.max_rounds}")
        if not 1 <= self.checkpoint_every <= 1_000_000:
            raise ValueError(f"checkpoint_every: must be in [1, 1000000], got {self.checkpoint_every}")
        if not 1 <= self.keep_checkpoints <= 1000:
            raise ValueError(f"keep_checkpoints: must be in [1, 1000], got {self.keep_checkpoints}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume: needs checkpoint_dir; pass --checkpoint-dir DIR")
        if self.start_fresh and not self.resume:
            raise ValueError("start_fresh: applies only with --resume (it says what to do when every checkpoint "
                             "is damaged)")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in [1, 65535], got {self.metrics_port}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")


@dataclass
class TrainConfig:
    """Everything a single peer needs to train locally; the swarm settings nest beside it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.inner.total_steps == 0 and self.run.max_rounds:
            # a round is H steps, or H / F with fragments (each fragment round is one round: RunConfig.max_rounds)
            self.inner.total_steps = max(1, self.run.max_rounds * self.outer.local_steps // self.outer.fragments)
        if self.run.eval_every is None:
            # a round is H / F steps with fragments: the cadence keeps the cost share the same
            self.run.eval_every = default_eval_every(max(1, self.outer.local_steps // self.outer.fragments),
                                                     self.data.eval_batches)


EVAL_SHARE = 0.03
"""The default evaluation cadence keeps evaluations under this share of the inner steps' compute."""
EVAL_BATCH_COST = 1 / 3
"""An evaluation batch (forward only) in training steps (forward, backward, optimizer): a backward costs about
two forwards. Measured on the tiny preset (CPU, one thread, batch 16 x 128): 0.23-0.34."""


def default_eval_every(local_steps: int, eval_batches: int) -> int:
    """Rounds between evaluations when ``--eval-every`` is not given: the fewest for which ``eval_batches``
    forward passes cost at most ``EVAL_SHARE`` of the ``local_steps`` inner steps in between."""
    return max(1, math.ceil(eval_batches * EVAL_BATCH_COST / (EVAL_SHARE * local_steps) - 1e-9))


@dataclass
class TrackingConfig:
    """Where each round's record goes besides the JSON-lines log; all optional."""

    wandb_project: str | None = None
    """Weights & Biases project to log each round to (one W&B run per peer, grouped by run id; default: no
    W&B). Needs the wandb package and a login (or WANDB_MODE=offline)."""

    wandb_entity: str | None = None
    """W&B team or user owning the project. Default: the logged-in user's default entity."""

    tensorboard_dir: str | None = None
    """Folder for TensorBoard event files, one sub-folder per peer id, viewed with tensorboard --logdir DIR
    (default: none). Needs the tensorboard package."""

    def __post_init__(self) -> None:
        for name in ("wandb_project", "wandb_entity", "tensorboard_dir"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: must not be empty; leave it out to disable it")
        if self.wandb_entity and not self.wandb_project:
            raise ValueError("wandb_entity: needs wandb_project; pass --wandb-project NAME too")

    @property
    def enabled(self) -> bool:
        return bool(self.wandb_project or self.tensorboard_dir)
