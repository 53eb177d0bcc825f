"""A junk manifest answer cannot cut republishing or relayed donors out of a joiner's download (issue 51,
finding 5a): the grace after the first answer has a floor that covers them, whoever answered first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from hivemind.proto import averaging_pb2

from p2p_diloco.core.chunks import DONOR_REPUBLISH_S, MANIFEST_GRACE_S, RELAYED_ROUND_TRIP_S, manifest_wait_s
from p2p_diloco.swarm.chunk_transfer import REPUBLISH_WAIT_S, ChunkFetcher

HONEST_DELAY_S = REPUBLISH_WAIT_S + 0.5
"""A donor that was republishing (its whole wait) and then answered over a quick link."""


def test_the_grace_covers_a_republishing_donor_behind_a_relay() -> None:
    assert REPUBLISH_WAIT_S <= DONOR_REPUBLISH_S
    assert MANIFEST_GRACE_S >= REPUBLISH_WAIT_S + RELAYED_ROUND_TRIP_S
    junk_first = 0.001  # a self-declared donor at the top of the directory answers at once
    assert manifest_wait_s(junk_first, 30.0) >= REPUBLISH_WAIT_S + RELAYED_ROUND_TRIP_S
    assert manifest_wait_s(None, 30.0) == 30.0
    assert manifest_wait_s(junk_first, 3.0) == 3.0  # never past the timeout


class _Donor:
    def __init__(self, delay_s: float, metadata: bytes) -> None:
        self.delay_s, self.metadata = delay_s, metadata

    async def rpc_state_chunk(self, _request: averaging_pb2.DownloadData) -> AsyncIterator[averaging_pb2.DownloadData]:
        async def answer() -> AsyncIterator[averaging_pb2.DownloadData]:
            await asyncio.sleep(self.delay_s)  # the donor's latency, the subject of this test
            yield averaging_pb2.DownloadData(metadata=self.metadata)

        return answer()


class _Future:
    def __init__(self) -> None:
        self.result: Any = None

    def set_result(self, value: Any) -> None:
        self.result = value

    def set_exception(self, error: BaseException) -> None:
        raise error


def test_a_junk_first_answer_leaves_the_republishing_donor_its_manifest() -> None:
    donors = {"junk": _Donor(0.0, b"\xff" * 16), "honest": _Donor(HONEST_DELAY_S, b"manifest")}
    fetcher = ChunkFetcher(lambda peer: donors[peer], next_chunk_timeout=30.0)
    future = _Future()
    asyncio.run(fetcher.fetch_manifests(["junk", "honest"], 30.0, 1 << 16, None, future))  # type: ignore[arg-type]
    assert future.result == {"junk": b"\xff" * 16, "honest": b"manifest"}
