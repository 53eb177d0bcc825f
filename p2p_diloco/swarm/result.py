"""What one averaging round produced for this peer: the contract between ``RoundAverager`` and the session.

The type lives in the network-free core (:class:`p2p_diloco.core.rounds.RoundResult`), so the simulator's
in-process group returns the very same object; this module only names it for the swarm layer.
"""

from p2p_diloco.core.rounds import Outcome, RoundResult

__all__ = ["Outcome", "RoundResult"]
