"""Which epoch claims, checksums and donor states a peer believes: trust from what it saw, not head counts.

Identities are free in an open swarm: a fresh key is a new peer id, so one machine can sign a thousand
progress records and a thousand checksum votes. Counting records ("the largest epoch anybody claims", "the
checksum most peers published") hands the swarm to whoever makes the most ids. This module decides instead
from evidence this peer can check itself, network-free (the swarm and the simulator feed it peer ids,
epochs and digests):

- **Trusted peers** are the peers listed in ``--trusted-peers`` (a run's organisers) and the peers this peer
  *vouched for* itself: members that carried weight in a group whose all-reduce it completed (they sent parts
  that passed every check at receipt and confirmed the same result), for :data:`VOUCH_S` after their last
  such round, and, for a peer that trusted nobody visible when it loaded
  a verified state, the donor that delivered most of its verified bytes (its lineage is now this peer's
  own; :func:`credited`), only until this peer's first complete all-reduce (:meth:`Evidence.averaged_with`).
  A record costs nothing; a vouch costs taking part in a real round with this peer, with weight.
- **A relay earns nothing.** A state or round update that a peer accepted on trusted evidence (a trusted
  donor, or a digest trusted voters published) vouches for nobody new: chunks are content-addressed, so any
  identity can relay the honest swarm's bytes, and crediting it made one relayed manifest and two relayed
  chunks enough to be trusted, then to serve a state of its own making at epoch +1000 to that peer and,
  through it, to every peer that trusted it (a whole swarm with ``--trusted-peers``, measured). An identity
  that delivered no verified byte is never credited, and the one named is the one that delivered the most.
- **Anchored**: at least one trusted peer (other than this one) has a live progress record. An anchored
  peer believes only trusted peers' epochs: a Sybil's epoch +10^6 changes nothing for it. A peer that is not
  anchored (a newcomer, or one whose every trusted peer left) follows the largest epoch claimed, as before.
  That is what lets an honest peer that stepped alone before the others arrived bring them to its state,
  and keeps the swarm from splitting at start-up: newcomers adopt its state and vouch for it on download.
- **Unbacked claims**: when a peer acts on untrusted claims (it is not anchored) and no donor serves an
  acceptable state of that epoch, every untrusted peer claiming that epoch or more is ignored for a while:
  ``UNBACKED_FIRST_S``, doubling with each further failure up to ``UNBACKED_MAX_S``. A claim with nothing
  behind it costs one failed download per window, then stops stalling the peer; an honest donor that was
  only slow is believed again a minute later.
- **Checksum votes** count only trusted voters and this peer itself (:func:`outvoted`): a peer resyncs
  because peers it averaged with hold other parameters more often than its own, never because k fresh ids
  say so; a tie goes to the lowest digest, so a round whose group split closes the split.
- **Donor states** (:func:`state_verdict`): from a trusted donor, accepted unless trusted voters published
  another digest for that epoch; from anyone else, only when trusted voters published its digest. A peer
  that trusts nobody visible uses the votes only to choose among donors: it prefers a verified state no
  strict majority of voters contradicts, and takes a contradicted one when no other is acceptable
  (``swarm.state.download_state``). Voters it cannot tell apart are a head count of free identities: ten
  Sybil votes against the one honest donor's digest kept joiners from the honest state, and two newcomers
  then trained apart from the peer that was ahead (a split at start-up, seen in
  ``tests/integration/test_red_team.py``). An attacker that serves a state can vote for it as well, so a
  veto protected nothing in exchange; against a lone corrupt donor among honest voting ones the
  preference still picks the honest state. A brand-new joiner without ``--trusted-peers`` has nothing
  better to check a state against.
- **Epochs are bounded** by :data:`EPOCH_LIMIT`: claims and states beyond it are implausible and ignored,
  far below the wire formats' 10^9, so no accepted epoch can overflow them.

What this does not stop is written in ``docs/threat_model.md``: an attacker that takes part in rounds becomes
vouched, and a brand-new joiner without ``--trusted-peers`` has nothing to check a state against.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

EPOCH_LIMIT = 10**8
"""The largest epoch a record, a donor state or a checkpoint may carry. 10^8 rounds is three centuries at
one round a minute, and it leaves 9 x 10^8 rounds of headroom below the 10^9 of the wire formats."""

UNBACKED_FIRST_S = 60.0
"""How long an untrusted claim with no acceptable state behind it is ignored after its first failed
download; each further failure doubles it, up to :data:`UNBACKED_MAX_S` (see :meth:`Evidence.unbacked`).
Short at first because an honest donor may just have been slow or busy."""

UNBACKED_MAX_S = 900.0

VOUCH_S = 24 * 3600.0
"""How long a complete all-reduce vouches for a groupmate that carried weight in it; each such round renews it.
Choose it well above the longest gap between two rounds this peer shares with an honest member (about the
number of groups, in rounds): a lapsed vouch only stops trusting a peer until their next round together."""


@dataclass(frozen=True)
class Claim:
    """One live progress record's claim: ``peer_id`` is at ``epoch`` (client-mode peers excluded)."""

    peer_id: str
    epoch: int


def plausible_epoch(epoch: object) -> bool:
    """An integer epoch within ``[0, EPOCH_LIMIT]``."""
    return isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch <= EPOCH_LIMIT


def strict_majority(votes: Mapping[str, str]) -> str | None:
    """The digest more than half of ``votes`` (voter -> digest) agree on, or ``None``."""
    if not votes:
        return None
    digest, count = min(Counter(votes.values()).items(), key=lambda item: (-item[1], item[0]))
    return digest if 2 * count > len(votes) else None


def outvoted(trusted_votes: Mapping[str, str], mine: str) -> bool:
    """Trusted voters published a digest other than ``mine`` more often than ``mine`` was published, this
    peer's own vote included; a tie goes to the lowest digest (we drifted, or our group split from theirs).

    Why this peer's own vote counts and why ties are broken: a round's peers can split into two groups of the
    same epoch (matchmaking is not one global agreement), and the two halves then hold different parameters.
    Counting only the others' votes, each peer of a 2-2 split saw the other half as a strict majority (one
    of its own side against two of the other), so all four resynced to the other side's state and the split
    swapped sides instead of closing; and an even split with no majority would never close at all. With
    this peer's vote counted and the tie broken by a rule every peer evaluates alike (the lowest digest),
    one side stays and the other loads its state. Only trusted voters count, so a tie cannot be made with
    free identities; a lone peer facing one trusted voter of another digest moves only if that digest is
    the lower (before, it always moved)."""
    votes = Counter(trusted_votes.values())
    votes[mine] += 1
    winner, _ = min(votes.items(), key=lambda item: (-item[1], item[0]))
    return winner != mine


def state_verdict(donor: str, digest: str, votes: Mapping[str, str], trusted: frozenset[str] | None) -> str | None:
    """Why a verified donor state (``digest``: parameters and momentum) must not be loaded, or ``None``.

    ``votes`` are every valid checksum published for the state's epoch (voter -> digest); ``trusted`` the
    peers this one trusts, or ``None`` when none of them is visible: then a veto here only ranks the donor
    last (see the module docstring and ``swarm.state.download_state``).
    """
    if trusted is None:
        major = strict_majority(votes)
        if major is not None and major != digest:
            count = sum(1 for v in votes.values() if v == major)
            return f"differ from the checksum {count}/{len(votes)} untrusted peers published"
        return None
    trusted_votes = {peer: d for peer, d in votes.items() if peer in trusted}
    major = strict_majority(trusted_votes)
    if major is not None and major != digest:
        count = sum(1 for v in trusted_votes.values() if v == major)
        return f"differ from the checksum {count}/{len(trusted_votes)} trusted peers published"
    if donor in trusted or digest == major:
        return None
    return "the donor is not a trusted peer and no trusted peer published this checksum"


def credited(delivered: Mapping[str, int], trusted: frozenset[str] | None) -> str | None:
    """The identity a loaded state vouches for: ``None`` when it was accepted on trusted evidence (``trusted``
    is not ``None``: a trusted donor or trusted voters vouched for its digest, and whoever relayed its bytes
    proved nothing of its own), else the donor that delivered the most verified chunks (``delivered``: donor
    -> count; ties go to the smallest id), never one that delivered none. See the module docstring."""
    if trusted is not None:
        return None
    counted = [(n, peer) for peer, n in delivered.items() if n > 0]
    return min(counted, key=lambda item: (-item[0], item[1]))[1] if counted else None


MOVED_ON_PASSES = 3
"""Failed downloads in a row, whoever served them, after which donors that moved on mid-download are ignored
like any others (``Evidence.unbacked``). An honest swarm a joiner cannot keep up with is better served by the
catch-up path (``swarm.catchup``) than by a fourth try; an attacker gets three, however many identities it has."""


class Evidence:
    """One peer's trust ledger; see the module docstring.

    Args:
        me: this peer's id (never counts as its own anchor).
        trusted: peer ids whose claims and checksums are authoritative (``--trusted-peers``).
        unbacked_s: how long untrusted claims with no acceptable state behind them are ignored after a first
            failed download, and the most after repeated ones.
        clock: monotonic seconds (the simulator passes its virtual clock).
        vouch_s: how long a round vouches for a groupmate (:data:`VOUCH_S`).
    """

    def __init__(self, me: str = "", trusted: Iterable[str] = (), *,
                 unbacked_s: tuple[float, float] = (UNBACKED_FIRST_S, UNBACKED_MAX_S),
                 clock: Callable[[], float] = time.monotonic, vouch_s: float = VOUCH_S) -> None:
        self.me = me
        self.configured = frozenset(trusted)
        self.vouch_s = vouch_s
        self.vouched: dict[str, float] = {}
        """Peer id -> until when (``clock``) this peer vouches for it (:meth:`averaged_with`)."""
        self.adopted: set[str] = set()
        """Donors credited for a state this peer loaded while it trusted nobody visible (:meth:`loaded`): trusted
        only until this peer completes an all-reduce of its own, see :meth:`averaged_with`."""
        self.unbacked_s, self._clock = unbacked_s, clock
        self._unbacked: dict[str, float] = {}
        """peer id -> until when its (untrusted) claims are ignored."""
        self._strikes: dict[str, int] = {}
        """peer id -> failed downloads its claims caused (doubles the next window)."""
        self._passes = 0
        """Failed downloads in a row forgiven because their donors moved on mid-download (``unbacked``), counted
        for this peer, not per donor: k identities got ``MOVED_ON_PASSES`` forgiven tries each before."""

    def trusts(self, peer: str) -> bool:
        return peer in self.configured or peer in self.adopted or self.vouched.get(peer, -math.inf) > self._clock()

    @property
    def trusted(self) -> frozenset[str]:
        now = self._clock()
        return self.configured | self.adopted | {peer for peer, until in self.vouched.items() if until > now}

    def anchored(self, visible: Iterable[str]) -> bool:
        """Some trusted peer other than this one is among ``visible`` (live progress records)."""
        return any(p != self.me and self.trusts(p) for p in visible)

    def believed(self, claims: Sequence[Claim]) -> list[Claim]:
        """The claims this peer acts on: plausible ones; only trusted peers' (and its own) when anchored,
        else all but unbacked ones."""
        now = self._clock()
        plausible = [c for c in claims if plausible_epoch(c.epoch)]
        if self.anchored(c.peer_id for c in plausible):
            return [c for c in plausible if c.peer_id == self.me or self.trusts(c.peer_id)]
        return [c for c in plausible if self._unbacked.get(c.peer_id, -1.0) <= now]

    def swarm_epoch(self, claims: Sequence[Claim]) -> int | None:
        """The largest believed epoch (:meth:`believed`), ``None`` when no claim is believed."""
        return max((c.epoch for c in self.believed(claims)), default=None)

    def left_behind(self, claims: Sequence[Claim], epoch: int) -> bool:
        """Every believed peer but this one is past ``epoch``: nobody is left to form the group of ``epoch``
        with, so a peer still looking for it gives the round up instead of waiting out
        ``matchmaking_timeout_s`` (it then resyncs and folds its work into a later round).

        "Every" and not "some": when a round splits into several groups, the first group to finish publishes
        ``epoch + 1`` while the others still assemble; they must not give up then. A peer one epoch behind
        (downloading) keeps the round open too: it may still join. Only believed claims count, so Sybil
        records cannot end an anchored peer's round, and one that is not anchored gives up only when the
        only peers it sees are past it."""
        others = [c for c in self.believed(claims) if c.peer_id != self.me]
        return bool(others) and all(c.epoch > epoch for c in others)

    def round_over(self, claims: Sequence[Claim], epoch: int, voters: Collection[str]) -> bool:
        """:meth:`left_behind`, and every believed peer but this one published its checksum of ``epoch + 1``
        (``voters``): each of them finished the round of ``epoch``, so no group of it is left to form. Asked
        while this peer's matchmaking window is still open, where a record alone does not say as much.

        Why the checksum: an eager peer publishes ``epoch + 1`` as soon as it launches the all-reduce of
        ``epoch``, which may still be looking for a group this peer would join; eager peers publish no checksum
        (their parameters differ by design), so their records never end a window early, and neither does a
        peer that resynced (it votes for nothing it did not average). Why it matters: a peer one round behind
        (its download or catch-up outlasted the others' inner phase) searched alone for a whole window after
        the group it was late for had formed, then caught up while the next group formed without it, round
        after round (measured through a relay: 4 rounds in a row)."""
        others = [c for c in self.believed(claims) if c.peer_id != self.me]
        return bool(others) and all(c.epoch > epoch and c.peer_id in voters for c in others)

    def trusted_or_none(self, visible: Iterable[str]) -> frozenset[str] | None:
        """What :func:`state_verdict` takes: the trusted set when anchored, else ``None``."""
        return self.trusted if self.anchored(visible) else None

    def trusted_votes(self, votes: Mapping[str, str]) -> dict[str, str]:
        return {peer: digest for peer, digest in votes.items() if peer != self.me and self.trusts(peer)}

    # ------------------------------------------------------------------ what this peer saw

    def averaged_with(self, contributors: Sequence[str], weights: Sequence[float] | None = None) -> None:
        """A complete all-reduce with ``contributors``: those that carried weight in it (``weights[k] > 0``, fresh
        plus late work, as ``RoundResult.weights`` and ``stale_weights`` give them; ``None``: all of them) are
        vouched for the next ``vouch_s`` seconds, and once one is, the donors adopted on a download
        (:meth:`loaded`) are trusted no more, unless they were among them.

        Why weight: a zero-weight client completes rounds without contributing anything (its part is zeros),
        and a vouch makes its signed records prove it alive (they hold the round's window open) and its speed
        count for DyLU. With weight it must send a part the reducers' norm screen accepts, and the vouch lapses
        unless it keeps doing so.

        Why the adopted donors go: a newcomer that trusts nobody credits the donor that delivered most of its
        state, and that identity may be a relay of the honest swarm's bytes (content-addressed chunks prove
        nothing about who made them). Kept for good, it stayed trusted beside the peers this one then averaged
        with: its later claim of a future epoch was believed and its own state loaded from it as a trusted
        donor, and the peers that averaged with this one (vouching for it) followed. The credit exists to
        anchor a newcomer between its download and its first round (Sybil epochs change nothing for it
        meanwhile); once it averaged, its groupmates anchor it on evidence of their own."""
        if weights is not None and len(weights) != len(contributors):
            logger.warning("A round named %d contributors but %d weights: vouching for nobody",
                           len(contributors), len(weights))
            return
        carried = [w > 0 and math.isfinite(w) for w in weights] if weights is not None else [True] * len(contributors)
        vouched = [peer for peer, yes in zip(contributors, carried, strict=True) if yes and peer != self.me]
        if vouched:
            self.adopted.clear()
        until = self._clock() + self.vouch_s
        for peer in vouched:
            self.vouched[peer] = until
            self._unbacked.pop(peer, None)
            self._strikes.pop(peer, None)

    def adopted_from(self, donor: str) -> None:
        """This peer loaded ``donor``'s verified state while it trusted nobody visible: ``donor`` anchors it until
        its first complete all-reduce (:meth:`averaged_with`)."""
        if donor not in self.adopted:
            logger.info("Trusting %s until our first round: it delivered most of the state we loaded while we "
                        "trusted nobody online", donor)
        self.adopted.add(donor)
        self._unbacked.pop(donor, None)
        self._strikes.pop(donor, None)
        self._passes = 0

    def loaded(self, delivered: Mapping[str, int], trusted: frozenset[str] | None) -> str | None:
        """This peer loaded a verified state (or applied a verified round update) whose chunks ``delivered``
        came from (donor -> verified chunks), checked against ``trusted`` (what :meth:`trusted_or_none` said
        when the transfer began). Vouches for :func:`credited`'s choice; returns it, or ``None``."""
        self._passes = 0
        donor = credited(delivered, trusted)
        if donor is not None:
            self.adopted_from(donor)
        return donor

    def unbacked(self, claims: Sequence[Claim], min_epoch: int, served: Mapping[str, int] | None = None,
                 now: Sequence[Claim] = ()) -> dict[str, float]:
        """No acceptable state of ``min_epoch`` or newer could be downloaded: ignore the untrusted peers
        claiming it for a while (see ``unbacked_s``). Returns the peers now ignored, with for how many seconds.

        Trusted claims stay (their donors may be busy or cut off: the round policy carries the work and tries
        again). So does the claim of a donor in ``served`` (peer -> epoch of the state whose manifest it handed
        out before it stopped serving it, chunks delivered or not) whose record in ``now`` (the records read
        after the download) still claims ``min_epoch`` (the epoch asked for) or that state's epoch or later: it
        stepped on to the next round's state mid-download, the usual fate of a slow or loaded joiner, and its
        record may not say so yet (it publishes after its outer step, in the background). Why ``min_epoch`` and
        not the served state's epoch: a manifest can be of a state newer than the donor's record (it served the
        state it had just stepped to, its record not yet rewritten), and was counted as going back. Seen in
        ``tests/integration/test_peer_swarm.py``: a joiner's second failed download (believed epoch 20, three
        honest donors of one-second rounds that had handed out manifests) struck all three for 60 s, and it
        trained alone from epoch 0; their records had not gone back, so their manifests were of a newer state
        than the records said. An attacker gains nothing: it writes its own record, and
        ``MOVED_ON_PASSES`` bounds the forgiveness either way. Ignoring such donors left a joiner training rounds
        alone from its own state (seen: a loaded joiner whose three donors all stepped on between their manifests
        and its first chunk, within one second). A donor whose record went back or vanished gets its strike as any
        other, and so does every donor once ``MOVED_ON_PASSES`` failed downloads in a row were forgiven (an
        attacker could hand out a manifest and keep its claim each time; the count starts again once this peer
        loads a state). The count is this peer's, not each donor's: per donor, k free identities taking turns
        got 3k forgiven downloads of up to ``state_download_timeout_s`` each, while honest donors of one swarm
        step on together and share one."""
        now_epochs = {c.peer_id: c.epoch for c in now}
        moved_on = {peer for peer, epoch in (served or {}).items()
                    if now_epochs.get(peer, -1) >= min(epoch, min_epoch)} if self._passes < MOVED_ON_PASSES else set()
        if moved_on:
            self._passes += 1
            logger.info("Forgiven (failed download %d of %d in a row): %s", self._passes, MOVED_ON_PASSES,
                        ", ".join(f"{p} served epoch {(served or {})[p]}, its record says {now_epochs[p]}"
                                  for p in sorted(moved_on)))
        now_s, (first, most) = self._clock(), self.unbacked_s
        marked = {}
        for claim in claims:
            peer = claim.peer_id
            if claim.epoch >= min_epoch and peer != self.me and not self.trusts(peer) and peer not in moved_on:
                strikes = self._strikes[peer] = self._strikes.get(peer, 0) + 1
                marked[peer] = min(most, first * 2 ** min(strikes - 1, 30))
                self._unbacked[peer] = now_s + marked[peer]
        return marked

    def forget(self, peer: str) -> None:
        """``peer`` was banned: it is not trusted any more."""
        self.vouched.pop(peer, None)
        self.adopted.discard(peer)
