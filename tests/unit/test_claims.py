"""Group metadata is signed by each member: a leader relaying it cannot forge a claim or frame a member."""

from __future__ import annotations

import dataclasses

from hivemind.averaging.allreduce import AveragingMode
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm.claims import open_gather, open_gathered, sign_gather, unsigned_payload
from p2p_diloco.swarm.group import MemberInfo, encode_gather, plan_group
from p2p_diloco.swarm.signing import peer_id_of_public_key

KEYS = [RSAPrivateKey() for _ in range(3)]  # honest A, honest B, hostile leader L
IDS = [peer_id_of_public_key(key.get_public_key().to_bytes()) for key in KEYS]


def _info(weight: float) -> MemberInfo:
    return MemberInfo.for_round("run", "abcdef0123456789", 7, weight, 0.0, 0, True, False, norm=1.0, stale_norm=0.0)


def _claim(member: int, weight: float) -> bytes:
    return sign_gather(encode_gather(None, AveragingMode.NODE, _info(weight)), KEYS[member])


def test_a_member_s_own_claim_opens_and_forgeries_do_not() -> None:
    claim = _claim(0, 10.0)
    inner = encode_gather(None, AveragingMode.NODE, _info(10.0))
    assert open_gather(claim, IDS[0]) == inner
    assert unsigned_payload(claim) == inner
    # the leader re-signs an inflated claim for A with its own key
    forged = sign_gather(encode_gather(None, AveragingMode.NODE, _info(1e11)), KEYS[2])
    assert "not by the member" in open_gather(forged, IDS[0])
    # or edits A's signed bytes in place
    _, carried, public, signature = MSGPackSerializer.loads(claim)
    edited = MSGPackSerializer.dumps([encode_gather(None, AveragingMode.NODE, _info(1e11)), carried, public,
                                      signature])
    assert open_gather(edited, IDS[0]) == "metadata signature does not verify"
    # or relays it unsigned, or as junk
    assert "not signed" in open_gather(MSGPackSerializer.dumps([inner]), IDS[0])
    assert "msgpack" in open_gather(b"\xc1", IDS[0])
    assert "sane size" in open_gather(b"x" * 10_000, IDS[0])


def test_a_leader_cannot_get_an_honest_member_banned_but_a_signed_lie_is_its_signer_s() -> None:
    # L relays A's true claim, a forged over-the-cap weight for B, and its own over-the-cap claim
    forged_b = sign_gather(encode_gather(None, AveragingMode.NODE, _info(1e11)), KEYS[2])
    gathered = open_gathered(IDS, [_claim(0, 10.0), forged_b, _claim(2, 1e11)])
    plan = plan_group(IDS, gathered, IDS[0], min_group_size=1, max_weight=1e8)
    refused = dict(plan.refused)
    assert "malformed" in refused[IDS[1].to_base58()] and "not by the member" in refused[IDS[1].to_base58()]
    assert dict(plan.rejected) .keys() == {IDS[2].to_base58()}  # only the signer of the lie is banned
    assert plan.peer_ids == (IDS[0],)
    # a leader that tampers with our own entry stops the round for us (plan_group refuses to plan)
    ours_forged = open_gathered(IDS[:1], [forged_b])
    try:
        plan_group(IDS[:1], ours_forged, IDS[0], min_group_size=1)
    except ValueError as e:
        assert "own metadata" in str(e)
    else:
        raise AssertionError("a forged own entry was planned with")


def test_signed_claims_carry_the_same_metadata() -> None:
    info = _info(3.0)
    inner = unsigned_payload(_claim(1, 3.0))
    assert inner is not None
    assert MemberInfo.from_wire(MSGPackSerializer.loads(MSGPackSerializer.loads(inner)[2])) == dataclasses.replace(info)
