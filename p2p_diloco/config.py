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
    """Sequences per forward/backward pass; lower it when the batch does not fit in memory. Must divide
    batch_size. Default: batch_size."""

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
    """Recompute each layer's activations in the backward pass instead of keeping them (transformers'
    ``gradient_checkpointing_enable``): activations shrink from every layer's to each layer's input plus one
    layer's, for about a third more compute per step. Turn it on when ``run_peer doctor`` says the
    activations do not fit."""

    weights_dtype: Literal["fp32", "bf16"] = "fp32"
    """How the training device stores weights, gradients and AdamW moments. 'fp32': 16 bytes per parameter.
    'bf16' (CUDA only): 8 bytes per parameter. The fp32 anchors on the host stay the source of truth of the
    outer step: each round starts from them rounded to bf16, and the pseudo-gradient is measured from that
    same rounded start. bf16 AdamW rounds away updates below about 2^-8 of a weight, so prefer fp32 when the
    model fits; pretrained models are loaded in this dtype directly."""

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
    """Inner steps per round for the fastest peer (H). Slower peers run fewer (DyLU). A round sends one
    pseudo-gradient, so the bytes per inner step fall as 1/H; pick H so a round takes well over the all-reduce
    time (about 10x with overlap 'none', about 1x with 'eager'). The DiLoCo paper uses 500.

    H also decides which outer lr and momentum work. The paper's 0.7 / 0.9 were tuned at H = 500 (150M
    model, k = 8, hundreds of rounds). At small H consecutive rounds' pseudo-gradients point the same way
    (cosine 0.5-0.8 measured at H = 20, k = 4) and momentum compounds them, so the outer step must be smaller:
    see ``lr`` and ``momentum``. Count the rounds your run will have (inner steps per peer / H): in our
    runs of 4-40 rounds (H = 5-50) momentum never paid and an outer lr of 1 was best; the paper's values were
    found with hundreds of rounds. Before a run, ``python -m p2p_diloco.simulate sweep --local-steps H --workers k``
    finds the outer settings for your H and k on a small proxy model (they transfer across model sizes; see
    that command's help)."""

    lr: float | None = field(default=None, metadata={"flag": "outer-lr"})
    """Outer learning rate η. Unset (the default): chosen from H (``local_steps``), ``expected_peers`` and
    ``overlap`` by ``core.outer_defaults`` and stated in the log at start: 1 below H = 100 (0.7 with eager
    overlap), else 0.4 for one peer, 0.6 for 2-7, 0.7 from 8 (with momentum 0.9); a value given always wins. When consecutive rounds agree, the outer step moves the shared parameters by up
    to about η / (1 − μ) times the averaged pseudo-gradient (μ = ``momentum``): the *effective outer step*.
    1 means "go to the peers' average" (η = 1, μ = 0 is FedAvg). How to choose (measured on the tiny preset,
    200 inner steps per worker, BENCHMARKS.md "Convergence" and its sweeps):

    - H about 500, hundreds of rounds (the paper's regime): η = 0.7 with μ = 0.9 (the rule's choice at k >= 8).
    - Tens of rounds (small H, or a short run): μ = 0 and η = 1. At k = 4, H = 20, 10 rounds (3 seeds)
      η = 1 was best; η = 0.7 cost 1.3%, 1.5 cost 4.6%, 0.3 cost 11%; the paper's 0.7 / 0.9 cost 9.8%.
      With 0.7 / 0.9 the outer step moved the parameters 6-7x as far as the averaged pseudo-gradient by the
      last round, undoing the inner lr's cosine decay: even a single worker ended 11% above plain training.
    - With H (k = 4, μ = 0, same 200 steps, so fewer rounds at larger H): the best η stayed 1 at H = 5
      (40 rounds), 20 and 50 (4 rounds), 3 seeds each. η = 1.5 cost 7.1%, 4.6% and 2.0%, η = 0.5 cost 5.0%
      at H = 5 and 6.6% at H = 50: longer rounds tolerate a larger outer step and punish a smaller one more;
      short rounds punish a step off 1 on both sides.
    - With k (H = 20, μ = 0): the best η was 1 at k = 2, 4 and 8 (k = 8 two seeds); η = 0.7 cost 1.4%, 1.3%
      and 2.0%, η = 1.5 cost 4.3%, 4.6% and 4.9%. The DiLoCo scaling-law study reports that the best outer
      lr depends on k at hundreds of rounds, so sweep at your k.
    - With the inner lr (k = 4, H = 20, one seed): the best η falls as the inner lr rises, which lengthens
      each pseudo-gradient: η = 1 at inner lr 5e-4 and 1e-3, 0.7 at 2e-3 (η = 1 there cost 1.5%). The
      inner warm-up (5, 20 or 60 of 200 steps) did not move it.
    - Per overlap mode (k = 4, H = 20): ``eager`` was best at η = 0.7 (0.5 and 1 cost 1.7% and 1.6%): its
      others' term is a round old, so a slightly smaller step. The asynchronous Delayed Nesterov simulator
      mode was best at 1 (0.7 cost 1.9%, 1.5 cost 2.7%).
    - Check your own H and k with ``python -m p2p_diloco.simulate sweep``; lower η when a sweep's best sits
      at its largest momentum, raise it toward 1 when momentum is 0."""

    momentum: float | None = field(default=None, metadata={"flag": "outer-momentum"})
    """Outer Nesterov momentum μ. Unset (the default): 0 below H = 100 and 0.9 from H = 100 on, chosen by
    ``core.outer_defaults`` and stated in the log at start; a value given always wins. 0 turns the outer step into plain SGD (FedAvg with lr 1). Momentum re-applies
    each round's pseudo-gradient about 1/(1 − μ) times over the following rounds (10 at 0.9), so it pays off
    over many rounds and amplifies a direction that repeats round after round (small H). The paper's 0.9 suits
    H about 500 and hundreds of rounds. With tens of rounds it did not pay in our sweeps (tiny preset, k = 4,
    H = 20, 10 rounds, 3 seeds): the best setting with momentum, lr 0.3 and μ = 0.6, ended 1.3% behind lr 1
    without, and equal to lr 0.7 without (the same effective step lr / (1 − μ), 0.75 against 0.7); μ = 0.9
    cost 3-15% depending on lr; eager and asynchronous Delayed Nesterov lost 10% at μ = 0.6 (one seed), since
    momentum compounds their stale terms. At H = 5 over 40 rounds (one seed), effective step 1 with μ = 0.6
    or 0.9 still ended 1.6% and 8.9% behind μ = 0. When you change μ, keep lr / (1 − μ) about the same, and keep
    lr at most 1: at effective steps of 1.5-3 a large lr cost more than a large μ (lr 1.5, μ 0: +4.6%;
    lr 1, μ 0.6: +6.7%; lr 0.3, μ 0.9: +2.8%). Keep μ below 1."""

    expected_peers: int = 8
    """About how many peers you expect in a round (k); used only to choose ``lr`` when it is not given (the
    best outer lr grows with the number of replicas at large H: 0.4 for 1, 0.6 for 2-7, 0.7 from 8). The
    default 8 is the DiLoCo paper's k, for which the rule gives the paper's 0.7 / 0.9 at H >= 100. Peers of
    one run should state the same number (every peer steps with its own outer settings)."""

    choice: OuterChoice | None = field(default=None, init=False, repr=False, metadata={"cli": False})
    """How ``lr`` and ``momentum`` were chosen (filled in by validation; the peer logs it at start)."""

    min_local_steps: int = 5
    """Floor on a slow peer's DyLU step count, so that its contribution is worth the round trip."""

    compression: CodecName = "none"
    """Codec for pseudo-gradients on the wire: fp16 halves the bytes, int8 quarters them, 4bit sends about
    1/8 of fp32 (per-block scales), 2bit 1/14 (a sign and one of two fitted levels per value; only with
    ``error_feedback``). 'topk' sends the ``topk_k`` largest of every ``topk_chunk_size`` values at 2 bits
    with 12-bit positions (1/140 of fp32 at 64 of 4096; 'topk-sign': signs only, 1/153), and the reducers
    answer with the aggregate's own top-k, so a round costs about 1/140 each way at any group size. The
    sparse codecs need ``error_feedback`` (98% of each round's values wait in it) and a larger outer step.
    Measured (BENCHMARKS.md, "Sparse-codec": tiny preset, 4 workers, 20 rounds of H = 10, 3 seeds, each codec
    at its best cell of an outer-lr sweep, momentum 0 best for all): none 2.2973 at lr 1; 4bit +0.36% at lr 1
    and 1/7.8 of the bytes; 2bit with error feedback 0.95 +1.11% at lr 1 and 1/14.2; topk 64/4096 with error
    feedback 0.95 and the reply's leftovers credited (``credit_undelivered``) +4.5% at lr 4 and 1/134 (lr 1,
    the published setting: +18.5%); topk 32/4096 +5.6% at lr 5 and 1/257. So the default stays 'none'
    (nothing to tune, exact); choose 4bit on home links (its cost is within the seeds' spread, on mini too),
    2bit with error feedback when 4bit's round is still too long, and topk when the uplink bounds the round
    (1B+ models at 10-50 Mbit/s) and a few percent of loss at equal steps is worth 18x fewer bytes than 4bit;
    then set ``lr`` from ``python -m p2p_diloco.simulate sweep --compression topk --error-feedback`` at your
    model, H and k (3-4 here, not the dense codecs' 1; tiny's best, 4, cost +10% on mini, where 3 cost +4%)."""

    topk_chunk_size: int = 4096
    """Values per chunk for the sparse codecs (a power of two, 16-32768): top-k is taken per chunk, so every
    region of the model gets ``topk_k / topk_chunk_size`` of the bandwidth. 4096 is the published setting;
    smaller chunks spread the bandwidth more evenly, larger ones let the largest values of a region win."""

    topk_k: int = 64
    """Values kept per chunk by the sparse codecs (1..chunk size): the bytes grow about linearly with it
    (64 of 4096 = 1.56%: 117 bytes per chunk, 1/140 of fp32). With error feedback a smaller k delays values
    rather than losing them; lower it when the uplink is the bottleneck, raise it if the loss suffers."""

    error_feedback: bool = False
    """Keep what lossy compression dropped and add it to the next round's pseudo-gradient. Needed with the
    sparse codecs; helps 4bit a little. One more model-sized fp32 buffer on the host (in the averager
    process), for the whole run."""

    error_feedback_decay: float | None = None
    """Factor on the carried error before it is added to the next round (0-1). Unset (the default): 0.95 with
    the sparse codecs, 1 with the others (:data:`SPARSE_ERROR_FEEDBACK_DECAY`). 1 keeps all of it: right for
    the dense codecs, whose error is a small rounding. With the sparse codecs a value may wait many rounds,
    and a stale direction is worth less than a fresh one: 0.95 (the published SparseLoCo setting; half-life 14
    rounds) forgets it geometrically. It also bounds the residual: at 1 whatever the top-k replies do not
    carry piles up round after round (``credit_undelivered``), in clean runs too when the same direction
    persists, until a fresh joiner's norm screen (20x) sees the veterans' parts as outliers and bans them; at
    0.95 a residual is at most about 20 rounds of input. Lower (0.8-0.9) for few, long rounds; 1 only for short
    sparse runs. 0 drops the error each round (no feedback at all)."""

    credit_undelivered: bool = True
    """With a sparse codec and ``error_feedback``: after a round that averaged, return to the residual every
    entry this peer sent that the reducers' top-k reply dropped, so it is delayed to a later round instead of
    lost (``swarm.hivemind_codecs``). Every member still applies the same reply, so parameters stay
    identical; only this peer's private residual changes. Costs no bytes and about 0.03 bytes per parameter
    for one round (the sent parts' payloads). Measured (BENCHMARKS.md, "Sparse-codec", simulator, tiny preset,
    topk 64/4096, error feedback 0.95, outer lr 1): +19.9% eval loss against none without, +15.4% with; the
    sweep's best settings (lr 4, +4.5%) were found with it on. So it is on; turn it off
    (``--credit-undelivered false``; the simulator reads the same flag) only to measure or reproduce a run
    without it. Ignored by the dense codecs, whose replies drop nothing (an entry a dense reply rounds to 0
    was delivered), and without error feedback, where there is no residual to credit."""

    overlap: Literal["none", "eager"] = "none"
    """'none': wait for each round's all-reduce before training on (every peer holds identical parameters).
    'eager': run round t's all-reduce in the background while round t+1 trains, and step with the eager rule
    (own work fresh, the others' one round old), hiding the all-reduce when it takes less than a round. Pick
    eager when the all-reduce costs a noticeable share of a round (slow links, large models); peers' parameters
    then differ by their last own term, and every peer of a run must use the same mode."""

    fragments: int = 1
    """Streaming DiLoCo (``core.fragments``): split the model into this many fragments that synchronise at
    staggered times, fragment f every ``local_steps`` steps offset by f·H/F, so a peer sends about 1/F of the
    model at a time and its peak bandwidth drops about F-fold for the same total bytes. 1 is plain DiLoCo. Layers
    are dealt out strided (layer i to fragment i mod F), so every fragment holds shallow and deep layers and
    each synchronisation refreshes a slice of the whole depth (the paper found strided slightly better than
    contiguous blocks); embeddings, final norm and head go to the lightest fragment, which keeps the largest
    fragment, and so the peak, near 1/F. F must be at most the model's layer count and at most H. Pick F so that
    a fragment's all-reduce fits in the link's budget (measurements: BENCHMARKS.md, "Streaming DiLoCo").
    A node of several GPUs refuses F > 1 for now."""

    fragment_delay: int = 0
    """τ, inner steps a fragment's all-reduce overlaps: its pseudo-gradient is taken at its sync step and its
    outer result is merged τ steps later, while training goes on. 0 blocks (the all-reduce must finish at
    once); larger τ spreads a fragment's bytes over τ steps, lowering the peak further, at the price of τ steps
    of local work the merge partly overwrites (see ``fragment_alpha``). At most H / F, so a fragment's all-reduce
    ends before the next fragment's starts (one fragment in flight at a time). A swarm peer runs the all-reduce
    on a thread of its own meanwhile and waits at the merge step for what τ steps did not hide; that wait also
    keeps the peers in step, so choose about H / 2F there (4 peers, 10 Mbit/s, H = 400, F = 4: 96.7% and 97.4%
    compute utilization at τ = 50 in two runs; at τ = 100 the peers drifted apart and rounds split). Measured
    in the simulator (tiny preset, 4 workers, H = 12, F = 4, 3 seeds, fp32): τ = 2 halved the peak again (0.14x
    DiLoCo's) and cost 0.5% of eval loss."""

    fragment_alpha: float = 0.0
    """α, how a fragment's outer result merges with the local copy: params ← α·local + (1 − α)·global. 0 takes
    the global result (with τ = 0 this is DiLoCo exactly); with τ > 0 the local copy holds τ steps of work the
    global one lacks, and α > 0 keeps part of it. In [0, 1). Measured with τ = 2 (tiny preset, F = 4, 3 seeds):
    at fp32 α = 0 and 0.5 ended equal (+0.49% and +0.52% against DiLoCo); with the topk-sign codec α = 0.5
    ended 23% below DiLoCo on a 5-round run, since it keeps local work the sparse codec has not delivered yet,
    and α = 0 0.9% above. Check α at your run length with the simulator."""

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
    """Save a checkpoint every this many rounds (written in the background from the live outer state; the
    next outer step waits for it). 5 by default: a checkpoint is 8 bytes per parameter (8 GB at 1B), and at
    H = 500 a round is minutes to tens of minutes, so every 5th round bounds what a lost machine costs to
    about an hour of its training while writing a tenth of the disk traffic of every round. A restarting
    peer downloads the swarm's newer state anyway; its own checkpoint matters when the whole swarm stopped.
    Use 1 for short runs and tests."""

    keep_checkpoints: int = 3
    """How many complete checkpoints to keep; older ones are deleted after a new one is written."""

    resume: bool = False
    """Continue from the newest complete checkpoint in checkpoint_dir. Damaged checkpoints are skipped for
    the next newest; when every one is damaged the peer stops (see start_fresh). A checkpoint of another
    run, model or seq_len is refused."""

    start_fresh: bool = False
    """With resume: when every checkpoint in checkpoint_dir is damaged, start without one instead of stopping.
    The damaged ones are kept, renamed damaged-ckpt-*, so no later save overwrites them."""

    log_file: str | None = None
    """Write one JSON line per event (round, eval, ...) to this file."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0.0.0.0). Default: no metrics endpoint."""

    eval_every: int | None = None
    """Evaluate on the held-out split at start, every this many rounds and after the last round of a run with
    ``max_rounds``; 0 disables evaluation entirely (no held-out split is read), e.g. for a local dataset too
    small to hold one sequence out. Unset (the default): the fewest rounds between evaluations that keep their
    cost under about 3% of the inner steps (:func:`default_eval_every`): every round from H = 100 at the
    default 8 ``eval_batches``, every 5th at H = 20. An evaluation is ``eval_batches`` forward passes on the
    training thread, and every peer pays it between rounds: measured on the tiny preset (CPU, one thread),
    8 batches took as long as 1.8-2.7 training steps, 9-13% of a round at H = 20. Set 1 to follow the eval
    loss round by round (a convergence study), 0 for the most throughput."""

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
    """Weights & Biases project to log each round to (one W&B run per peer, grouped by run id). Needs the
    wandb package and a login (or WANDB_MODE=offline). Default: no W&B."""

    wandb_entity: str | None = None
    """W&B team or user owning the project. Default: the logged-in user's default entity."""

    tensorboard_dir: str | None = None
    """Folder for TensorBoard event files, one sub-folder per peer id; view with tensorboard --logdir DIR.
    Needs the tensorboard package. Default: no TensorBoard."""

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
