"""One sender trying to own every top-k reply (issue 51, finding 3), through the project's own codec, error
feedback, reply codec and reducer, with the defaults an open swarm with a sparse codec gets.

Three honest senders keep error-feedback residuals and credit back what each reply drops
(``ErrorFeedback.credit_undelivered``), as the swarm does; their pseudo-gradients share a persistent direction
plus noise. The attacker sends top-k parts of a random direction at 5x an honest part's norm (under the norm
screen's 20x). Under ``mean`` the reply (the aggregate's own top-k) held only the attacker's entries: the
honest direction's agreement with it was about 0 and the honest residuals grew every round, until a fresh
joiner's norm screen banned the veterans.
"""

from __future__ import annotations

import asyncio

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.core.codecs import ErrorFeedback
from p2p_diloco.core.robust import reduce_part
from p2p_diloco.core.sparse import TopKCodec
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.reducer import RobustPartReducer

CHUNK, K = 1024, 16  # the default's share of a chunk (1/64), smaller so that the test is quick
NUMEL = 4 * CHUNK
SIGNAL = 3.0  # the persistent (shared) direction's size against each sender's noise, per value
ATTACK = 5.0  # the attacker's part norm / the honest parts' median norm
FACTOR = 20.0  # SwarmConfig.norm_outlier_factor's default
CODEC = TopKCodec(CHUNK, K)
REPLY = CODEC.reply_codec


def _open_sparse_defaults() -> tuple[str, float]:
    """The aggregation rule and error-feedback decay an open swarm (no allow-list) with top-k gets by default."""
    outer = OuterConfig(compression="topk", error_feedback=True, topk_chunk_size=CHUNK, topk_k=K)
    assert outer.error_feedback_decay is not None
    return SwarmConfig().aggregation_for(sparse=True), outer.error_feedback_decay


def _sparse(x: torch.Tensor) -> torch.Tensor:
    return CODEC.decode(CODEC.encode(x), (NUMEL,))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def _reduce(parts: list[torch.Tensor], method: str) -> torch.Tensor:
    """The reply every member applies: the project's reducer over one part, then the reply codec."""
    async def run() -> torch.Tensor:
        reducer = RobustPartReducer([torch.Size([NUMEL])], torch.float32, [f"p{i}" for i in range(len(parts))],
                                    [1.0] * len(parts), method=method, norm_factor=FACTOR, own=0, sparse=True)
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, p) for i, p in enumerate(parts)))
        assert not reducer.rejected()
        return results[0]

    value = asyncio.run(run())
    return REPLY.decode(REPLY.encode(value), (NUMEL,))


class _Swarm:
    """Three honest veterans with error feedback, and a fourth sender: honest and stateless, or the attacker."""

    def __init__(self, method: str, decay: float, seed: int = 0) -> None:
        self.method = method
        self.gen = torch.Generator().manual_seed(seed)
        self.direction = SIGNAL * torch.randn(NUMEL, generator=self.gen)
        self.veterans = [ErrorFeedback(CODEC, decay) for _ in range(3)]
        self.sent: list[torch.Tensor] = []
        self.attacker_share: list[float] = []

    def fresh(self) -> torch.Tensor:
        return self.direction + torch.randn(NUMEL, generator=self.gen)

    def round(self, attack: bool) -> float:
        """One round; returns the reply's agreement (cosine) with the honest senders' mean pseudo-gradient."""
        inputs = [self.fresh() for _ in self.veterans]
        self.sent = [CODEC.decode(f.encode("part", x), (NUMEL,)) for f, x in zip(self.veterans, inputs, strict=True)]
        if attack:
            noise = _sparse(torch.randn(NUMEL, generator=self.gen))
            honest_norm = float(torch.stack([s.norm() for s in self.sent]).median())
            fourth = noise * (ATTACK * honest_norm / noise.norm())
        else:
            fourth = _sparse(self.fresh())
        reply = _reduce([*self.sent, fourth], self.method)
        for feedback, sent in zip(self.veterans, self.sent, strict=True):
            feedback.credit_undelivered("part", sent, reply)
        if attack:  # the reply's squared norm on entries no honest sender sent: the attacker's alone
            alone = (fourth != 0) & (torch.stack(self.sent) == 0).all(0)
            self.attacker_share.append(float(reply[alone].square().sum() / reply.square().sum().clamp_min(1e-30)))
        return _cos(reply, torch.stack(inputs).mean(0))


def test_the_open_sparse_default_is_robust_and_forgets_old_error() -> None:
    assert _open_sparse_defaults() == ("centered-clip", 0.95)
    assert SwarmConfig(allowed_peers=None).aggregation_for(sparse=False) == "mean"  # dense replies: exact mean
    assert OuterConfig(compression="4bit").error_feedback_decay == 1.0
    assert OuterConfig(compression="topk", error_feedback_decay=1.0).error_feedback_decay == 1.0  # given: kept


def test_one_sender_cannot_own_the_topk_reply_under_the_open_default() -> None:
    method, decay = _open_sparse_defaults()
    rounds = 12
    clean, attacked = _Swarm(method, decay), _Swarm(method, decay)
    clean_agreement = sum(clean.round(attack=False) for _ in range(rounds)) / rounds
    agreement = sum(attacked.round(attack=True) for _ in range(rounds)) / rounds
    assert clean_agreement > 0.1
    # under mean: about 0 (the reply held the attacker's entries only)
    assert agreement >= 0.5 * clean_agreement, (agreement, clean_agreement)
    # the attacker's own entries hold a bounded share of the reply (under mean: all of it)
    assert max(attacked.attacker_share) < 0.5, attacked.attacker_share


def test_no_honest_veteran_is_banned_by_a_joiner_after_the_attacker_leaves() -> None:
    method, decay = _open_sparse_defaults()
    swarm = _Swarm(method, decay)
    for _ in range(40):  # under mean and decay 1.0 the veterans' parts reached 28x a joiner's
        swarm.round(attack=True)
    swarm.round(attack=False)  # the attacker left; veterans' parts now carry what the capture left behind
    veterans = swarm.sent
    joiners = [_sparse(swarm.fresh()) for _ in range(2)]
    # A group where fresh joiners are half: the screen's lower median is a joiner's part, and each joiner
    # anchors its own screen on its own part (core.robust.reduce_part's `own`).
    group = {0: veterans[0], 1: veterans[1], 2: joiners[0], 3: joiners[1]}
    for joiner in (2, 3):
        result = reduce_part(group, [1.0] * 4, method=method, norm_factor=FACTOR, own=joiner)
        assert result.outliers == () and result.dropped == (), result
    ratio = max(float(v.norm()) for v in veterans) / min(float(j.norm()) for j in joiners)
    assert ratio < FACTOR / 2, ratio


def test_the_robust_rules_reduce_sparse_parts_on_the_senders_entries_only() -> None:
    # aggregate() runs them on the union of the senders' entries (a fraction of a sparse part): the same values
    from p2p_diloco.core.robust import aggregate, centered_clip, trimmed_mean

    gen = torch.Generator().manual_seed(1)
    parts = [_sparse(torch.randn(NUMEL, generator=gen)) for _ in range(4)]
    parts[3] = parts[3] * ATTACK
    torch.testing.assert_close(aggregate(parts, "centered-clip"), centered_clip(parts), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aggregate(parts, "trimmed-mean"), trimmed_mean(parts), rtol=0, atol=0)
    dense = [torch.randn(8, generator=gen) for _ in range(4)]  # a dense part: the rule as it is
    assert torch.equal(aggregate(dense, "centered-clip"), centered_clip(dense))
    assert not aggregate([torch.zeros(NUMEL)] * 3, "centered-clip").any()
