"""Chunks of a state and who fetches which: the network-free half of the multi-donor state download.

A state (parameters, then outer momentum) is a list of tensors; its bytes, back to back, are cut into
chunks of :data:`CHUNK_BYTES`. :class:`ChunkMap` says which tensor bytes each chunk covers, so a chunk is
written straight into its destination tensors. Each region (the parameters, the momentum) starts a new chunk,
so each region's digest is computed from its own chunk digests (``swarm.checksum``).

:class:`ChunkPlan` is the assignment policy. It is pull-based: each donor asks for its next chunk when it has
fewer than ``depth`` requests out, so a slow donor simply fetches fewer chunks and a fast one more, with no
speed estimate to get wrong. When nothing is left to hand out, an idle donor is given a copy of the oldest
request still out at another donor (the first answer wins), so one slow donor cannot hold up the end of the
download. A donor that fails (error, refusal, a chunk that fails its hash) is dropped and its outstanding
chunks go back to the front of the queue for the others. The swarm side (``swarm.chunk_transfer``) runs the
requests; a fake drives the same class in ``tests/unit/test_chunks.py``.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

CHUNK_BYTES = 1 << 20
"""1 MiB. Small enough that a chunk takes about 8 s at 1 Mbit/s, so a donor that dies or stalls costs at most
a few seconds of transfer before its chunks move on, and a state of a few MB (the testbed's) still spreads
over several donors. Large enough that a 1B-parameter state (4 GB of parameters + 4 GB of momentum) is 8192
chunks: a 256 KiB manifest, and a request's overhead (one stream, one round trip, hidden by ``depth``
requests out per donor) is noise next to its transfer. It is part of the digest (``swarm.checksum``): every
peer of a run must use the same value."""

DIGEST_BYTES = 32
"""sha256."""


class ChunkMap:
    """Which bytes of which tensor each chunk holds.

    Args:
        regions: for each region (parameters, momentum), the byte size of each of its tensors, in order.
            Tensors are numbered across regions (the second region's first tensor follows the first's last).
    """

    def __init__(self, regions: Sequence[Sequence[int]], chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._starts: list[int] = []  # first chunk of each region
        self._offsets: list[list[int]] = []  # per region: cumulative byte offset of each tensor
        self._first_tensor: list[int] = []
        self.region_bytes: list[int] = []
        self.region_chunks: list[int] = []
        chunk, tensor = 0, 0
        for sizes in regions:
            if any(s < 0 for s in sizes):
                raise ValueError("tensor sizes must be non-negative")
            offsets = [0]
            for size in sizes:
                offsets.append(offsets[-1] + size)
            self._starts.append(chunk)
            self._offsets.append(offsets)
            self._first_tensor.append(tensor)
            self.region_bytes.append(offsets[-1])
            count = -(-offsets[-1] // chunk_bytes)
            self.region_chunks.append(count)
            chunk += count
            tensor += len(sizes)
        self.count = chunk
        self.total_bytes = sum(self.region_bytes)

    def region_of(self, index: int) -> tuple[int, int]:
        """``(region, index within it)`` of chunk ``index``."""
        if not 0 <= index < self.count:
            raise IndexError(f"chunk {index} out of range [0, {self.count})")
        region = bisect.bisect_right(self._starts, index) - 1
        while self.region_chunks[region] == 0 or index - self._starts[region] >= self.region_chunks[region]:
            region += 1  # skip empty regions that share a start
        return region, index - self._starts[region]

    def length(self, index: int) -> int:
        region, local = self.region_of(index)
        return min(self.chunk_bytes, self.region_bytes[region] - local * self.chunk_bytes)

    def spans(self, index: int) -> list[tuple[int, int, int]]:
        """``(tensor, start byte, stop byte)`` pieces of chunk ``index``, in order; their lengths add up to
        :meth:`length`."""
        region, local = self.region_of(index)
        offsets = self._offsets[region]
        begin = local * self.chunk_bytes
        end = min(begin + self.chunk_bytes, offsets[-1])
        out = []
        t = bisect.bisect_right(offsets, begin) - 1
        while begin < end:
            while offsets[t + 1] <= begin:
                t += 1  # empty tensors
            stop = min(end, offsets[t + 1])
            out.append((self._first_tensor[region] + t, begin - offsets[t], stop - offsets[t]))
            begin = stop
        return out

    def file_offset(self, index: int) -> int:
        """Where chunk ``index`` lies in a file holding every chunk at a fixed stride (partial downloads)."""
        return index * self.chunk_bytes


class ChunkPlan:
    """Which donor fetches which chunk (see the module docstring).

    Args:
        count: chunks in the state.
        donors: peers serving it (all the same digest: any of them can serve any chunk).
        have: chunks already verified (e.g. from a partial download on disk).
        depth: requests out per donor at once; 2 hides a request's round trip behind the previous transfer.
        copies: the most donors one chunk is requested from at once (the end-of-download duplicates).
        clock: monotonic seconds (a fake in tests).
    """

    def __init__(self, count: int, donors: Iterable[str], *, have: Iterable[int] = (), depth: int = 2,
                 copies: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        self.count, self.depth, self.copies, self._clock = count, depth, copies, clock
        self.done: set[int] = {i for i in have if 0 <= i < count}
        self.pending: deque[int] = deque(i for i in range(count) if i not in self.done)
        self.out: dict[str, dict[int, float]] = {d: {} for d in donors}
        """donor -> chunk -> when it was requested."""
        self.dropped: dict[str, str] = {}
        """donor -> why it was dropped."""
        self.served: dict[str, int] = dict.fromkeys(self.out, 0)
        """donor -> chunks it delivered first (and that passed their hash)."""
        self.overtaken: dict[str, int] = {}
        """donor -> its requests that another donor answered first (a slow donor; its copy is ignored)."""

    @property
    def finished(self) -> bool:
        return len(self.done) == self.count

    @property
    def hopeless(self) -> bool:
        """Every donor was dropped and chunks are missing."""
        return not self.finished and not self.out

    def _holders(self, chunk: int) -> int:
        return sum(1 for reqs in self.out.values() if chunk in reqs)

    def next(self, donor: str) -> int | None:
        """The chunk ``donor`` should fetch now, or ``None`` (dropped, enough requests out, or nothing left
        to hand out: wait for a change)."""
        requests = self.out.get(donor)
        if requests is None or len(requests) >= self.depth or self.finished:
            return None
        while self.pending:
            chunk = self.pending.popleft()
            if chunk not in self.done:
                requests[chunk] = self._clock()
                return chunk
        # the end: copy the oldest request out at another donor
        oldest: tuple[float, int] | None = None
        for other, reqs in self.out.items():
            if other == donor:
                continue
            for chunk, since in reqs.items():
                if chunk not in requests and chunk not in self.done and self._holders(chunk) < self.copies:
                    if oldest is None or since < oldest[0]:
                        oldest = (since, chunk)
        if oldest is None:
            return None
        requests[oldest[1]] = self._clock()
        return oldest[1]

    def received(self, donor: str, chunk: int) -> bool:
        """``donor`` delivered ``chunk`` and it passed its hash; ``True`` when it is the first copy (write it)."""
        requests = self.out.get(donor)
        asked = requests.pop(chunk, None) if requests is not None else None
        if chunk in self.done or not 0 <= chunk < self.count:
            return False
        self.done.add(chunk)
        self.served[donor] = self.served.get(donor, 0) + 1
        for other, reqs in self.out.items():
            if asked is not None and reqs.get(chunk, asked) < asked:  # asked before the winner, answered later
                self.overtaken[other] = self.overtaken.get(other, 0) + 1
        return True

    def failed(self, donor: str, reason: str) -> list[int]:
        """Drop ``donor``; its outstanding chunks that nobody else is fetching go back to the front of the
        queue. Returns them."""
        requests = self.out.pop(donor, None)
        if requests is None:
            return []
        self.dropped[donor] = reason
        back = [c for c in sorted(requests) if c not in self.done and self._holders(c) == 0]
        self.pending.extendleft(reversed(back))
        return back


SERVE_WAIT_SHARE = 0.15
"""The most a donor waits for downloads of its state before it changes it, per second it worked (:class:`ServeWait`).
It bounds what anybody downloading from it can cost its rounds: 1.15x at worst from the waits over any long
stretch, whatever the downloaders do (serving costs bandwidth and CPU on top), plus one burst of at most
:data:`SERVE_WAIT_BURST_S`."""

SERVE_WAIT_BURST_S = SERVE_WAIT_SHARE * 1800.0
"""270 s: the most budget a donor saves up while nobody downloads, so that a joiner gets a whole download's
time even from a swarm whose rounds are shorter than the download (it is one burst, then the share again).

Why a saved-up budget at all: a budget of 15% of the round alone starves every joiner of a swarm whose rounds
are short next to a download. A loopback swarm steps about twice a second, so each round allowed a joiner
0.1 s while downloading its few MB took 0.5-2 s: the download was cut off every round, and a peer that fell
a few rounds behind (a slow first round, a client behind NAT, a victim refusing a poisoner) never caught up.
Saved up, the donors that trained 20 s before the joiner came hold 3 s for it. Why 270 s (the share of 30
minutes of work): at 1B parameters a round is minutes long and a home download of the state is minutes too,
so a joiner after a quiet half hour gets up to 4.5 minutes from each donor; and the worst anybody can cost a
donor is that one burst over and above the share, once per 30 minutes of its work."""


class ServeWait:
    """How long a donor may still hold its round for the downloads of its state it serves: a token bucket
    no downloader can stretch.

    Why not the joiner's own download limit (``state_download_timeout_s``, 600 s): that waited for any open
    chunk stream, or a chunk served in the last 2 s, to anyone. One free identity fetching a chunk every
    second kept it waiting the whole limit every round (measured: rounds of 0.7 s became 33 s at a 30 s limit).
    Counting who downloads does not help either, as identities are free. The budget instead accrues at
    ``share`` per second the donor worked (the waits themselves excluded), saves up to ``burst_s`` and is
    spent by the seconds actually waited (:meth:`spend`). However long and however many identities keep
    downloading, the waits add up to at most ``burst_s + share * (time worked)``.

    Args:
        share: the budget per second worked (:data:`SERVE_WAIT_SHARE`).
        burst_s: the most budget saved up (:data:`SERVE_WAIT_BURST_S`); 0 gives every round only its own
            share of the time worked since the previous wait.
        clock: monotonic seconds (the simulator passes its virtual clock).
    """

    def __init__(self, share: float = SERVE_WAIT_SHARE, burst_s: float = SERVE_WAIT_BURST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the serving wait's share must be in [0, 1], got {share}")
        if not 0.0 <= burst_s < float("inf"):
            raise ValueError(f"the serving wait's burst must be a finite number of seconds >= 0, got {burst_s}")
        self.share, self.burst_s, self._clock = share, burst_s, clock
        self._since = clock()
        self._saved = 0.0
        self._granted: float | None = None  # the budget when the wait in progress began

    def _budget(self) -> float:
        earned = self.share * max(0.0, self._clock() - self._since)
        return min(max(self.burst_s, earned), self._saved + earned)

    def allowance(self, limit: float) -> float:
        """Seconds the donor may wait now, at most ``limit``: what it saved plus ``share`` of the time it worked
        since its last wait, saved up to ``burst_s`` (or that share alone, if more: a long round always gets
        its own). End the wait that follows with :meth:`spend`."""
        self._granted = self._budget()
        return max(0.0, min(limit, self._granted))

    def spend(self, waited_s: float) -> None:
        """The wait that followed :meth:`allowance` ended (downloads done or cut off) after ``waited_s``: it is
        taken from the budget, and the time it took is not work."""
        budget = self._granted if self._granted is not None else self._budget()
        self._saved, self._granted = max(0.0, budget - max(0.0, waited_s)), None
        self._since = self._clock()


DONOR_REPUBLISH_S = 2.0
"""How long a donor that has just stepped on may hold a manifest request before it answers with its new state
(``swarm.chunk_transfer.REPUBLISH_WAIT_S``, which must not exceed it)."""
RELAYED_ROUND_TRIP_S = 3.0
"""Room for a manifest request and its answer through a relay (stream set-up and one round trip each way,
with margin): a donor behind NAT answers that much later than one on the joiner's network."""
MANIFEST_GRACE_S = DONOR_REPUBLISH_S + RELAYED_ROUND_TRIP_S
"""How long, at least, the donors asked for a manifest still get once one of them answered (see
:func:`manifest_wait_s`): an honest donor that is republishing, or relayed, still answers within it, whatever
answered first. It is what a silent directory entry costs a joiner once another donor answered."""


def manifest_wait_s(first_s: float | None, timeout: float) -> float:
    """How long after asking a joiner waits for donors' manifests: ``timeout`` until one answers (``first_s``,
    seconds after asking, ``None`` while none did), then until ``first_s + max(MANIFEST_GRACE_S, first_s)``,
    never past ``timeout``.

    Why: waiting for every donor let one directory entry that never answers (a peer gone, or an attacker that
    accepts the stream and stays silent: entries are free) hold every download and catch-up of every joiner
    for the whole ``next_chunk_timeout_s`` (30 s by default) before a chunk was asked for; the honest donors
    had meanwhile stepped on and no longer served the state their manifests described (a joiner behind a
    dead entry never caught up with a swarm of short rounds, seen in
    ``tests/integration/test_poisoned_catch_up.py``). Donors that answer on the same network as the first
    answer within the grace; a slower one merely misses this attempt.

    The first answer may be anyone's (a free identity at the top of the directory answering at once, with
    junk or with an honest donor's manifest, which is public): the grace has a floor (``MANIFEST_GRACE_S``)
    that covers an honest donor's republishing and a relayed round trip, so such an answer cannot cut them
    out. Counting only a checked manifest as the first answer would not help: a relayed honest manifest
    passes every check."""
    if first_s is None:
        return timeout
    return min(timeout, first_s + max(MANIFEST_GRACE_S, first_s))
