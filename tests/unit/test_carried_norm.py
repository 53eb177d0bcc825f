"""What a sender's error feedback carries into its next parts: measured, bounded, announced and signed.

Issue 51, finding 4: members bound what a sender sends by ``gain * (s * claim + carried)``
(``core.bounds.fresh_limits``), where ``carried`` is ``ErrorFeedback.carried_norm``, signed with the group
metadata (``swarm.claims``). These tests check that the bound holds for every codec with error feedback, that
the norm follows the residuals, and that the signed form refuses what it must.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.bounds import CODEC_NORM_GAIN, FLOAT_SLACK
from p2p_diloco.core.codecs import ErrorFeedback, get_codec
from p2p_diloco.core.sparse import TopKCodec
from p2p_diloco.swarm.claims import MAX_CARRIED, open_claim, open_gather, sign_gather, unsigned_payload
from p2p_diloco.swarm.group import MemberInfo, decode_gather, encode_gather
from p2p_diloco.swarm.signing import peer_id_of_public_key

KEY = RSAPrivateKey()
ME = peer_id_of_public_key(KEY.get_public_key().to_bytes())


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


def _inner() -> bytes:
    info = MemberInfo.for_round("run", "abcdef0123456789", 7, 2.0, 0.0, 0, True, False, norm=1.5, stale_norm=0.0)
    return encode_gather(None, AveragingMode.NODE, info)


@pytest.mark.parametrize("name", ["topk", "topk-sign", "int8", "4bit", "2bit"])
def test_what_a_sender_sends_stays_within_its_norm_plus_what_it_carried(name: str) -> None:
    """The bound members hold senders to: ``|sent| <= gain * (|values| + carried_norm())``, every round, over
    many rounds of error feedback (a persistent direction, so the residuals grow), parts keyed as on the wire."""
    codec = get_codec(name, 64, chunk_size=256, k=4)
    feedback = ErrorFeedback(codec, decay=1.0)
    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(1000, generator=gen)
    grew = 0.0
    for _ in range(60):
        values = direction + 0.3 * torch.randn(1000, generator=gen)
        carried = feedback.carried_norm()
        pieces = values.split(384)
        sent = [codec.decode(feedback.encode((0, i), piece), piece.shape) for i, piece in enumerate(pieces)]
        total = math.sqrt(sum(_norm(s) ** 2 for s in sent))
        assert total <= FLOAT_SLACK * CODEC_NORM_GAIN[name] * (_norm(values) + carried)
        grew = max(grew, carried / _norm(values))
    if name.startswith("topk"):
        assert grew > 1.0  # the residual, not the values, is most of what a sparse sender sends


def test_the_chunked_topk_norm_is_a_norm_of_what_the_codec_selects() -> None:
    codec = TopKCodec(256, 4)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen) * 5
    assert codec.selection_norm(a + b) <= codec.selection_norm(a) + codec.selection_norm(b)
    assert codec.selection_norm(-3.0 * a) == pytest.approx(3.0 * codec.selection_norm(a))
    assert _norm(codec.roundtrip(a)) <= 1.01 * codec.selection_norm(a) < _norm(a)
    assert TopKCodec(256, 256).selection_norm(a) == pytest.approx(_norm(a))  # k = chunk: every value
    assert codec.selection_norm(torch.zeros(0)) == 0.0
    assert get_codec("int8").selection_norm(a) == pytest.approx(_norm(a))  # dense codecs: the L2 norm


def test_the_carried_norm_follows_the_residuals() -> None:
    codec = TopKCodec(256, 4)
    feedback = ErrorFeedback(codec, decay=0.5)
    assert feedback.carried_norm() == 0.0
    x = torch.randn(600, generator=torch.Generator().manual_seed(3))
    feedback.encode("a", x)
    residual = feedback.residual("a")
    assert residual is not None
    first = feedback.carried_norm()
    assert first == pytest.approx(0.5 * codec.selection_norm(residual))
    assert feedback.carried_norm() == first  # cached
    sent = codec.roundtrip(x + 0.0)
    feedback.credit_undelivered("a", sent, torch.zeros_like(sent))  # nothing delivered: all of it back
    assert feedback.carried_norm() > first
    clone = copy.deepcopy(feedback)  # a codec per fragment; the copy computes on its own
    assert clone.carried_norm() == feedback.carried_norm()
    feedback.reset()
    assert feedback.carried_norm() == 0.0 and clone.carried_norm() > 0.0


def test_the_carried_norm_is_signed_with_the_metadata() -> None:
    inner = _inner()
    raw = sign_gather(inner, KEY, 12.5)
    claim = open_claim(raw, ME)
    assert not isinstance(claim, str)
    assert claim.metadata == inner and claim.carried == 12.5
    assert open_gather(raw, ME) == inner and unsigned_payload(raw) == inner
    assert decode_gather(claim.metadata)[2].norm == 1.5
    # a leader that edits the carried norm (or moves bytes between the fields) breaks the signature
    metadata, _, public, signature = MSGPackSerializer.loads(raw)
    for carried in (0.0, 12.4, 1e6):
        edited = MSGPackSerializer.dumps([metadata, carried, public, signature])
        assert open_claim(edited, ME) == "metadata signature does not verify"
    # a previous version's entry (no carried norm) is refused, not misread
    old = MSGPackSerializer.dumps([inner, public, KEY.sign(inner)])
    assert "not signed" in open_claim(old, ME)


@pytest.mark.parametrize("carried", [math.nan, math.inf, -1.0, 2 * MAX_CARRIED, 3, True, "1.0", None, b"x"])
def test_a_carried_norm_outside_its_bounds_is_refused(carried: object) -> None:
    signature = KEY.sign(b"anything")
    raw = MSGPackSerializer.dumps([_inner(), carried, KEY.get_public_key().to_bytes(), signature])
    verdict = open_claim(raw, ME)
    assert isinstance(verdict, str) and ("carried norm" in verdict or "not signed" in verdict)
    if isinstance(carried, float):
        with pytest.raises(ValueError):
            sign_gather(_inner(), KEY, carried)
