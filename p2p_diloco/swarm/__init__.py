"""The hivemind swarm layer: DHT start-up, progress and checksum records, fault-tolerant averaging rounds
and verified state download. It moves lists of tensors and metadata; the caller applies the math."""

from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.checksum import layout_fingerprint, params_sha256
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import SwarmStartError, ensure_identity, start_dht, visible_maddrs
from p2p_diloco.swarm.records import (
    PeerProgress,
    fetch_checksums,
    fetch_progress,
    global_epoch,
    install_validators,
    majority_checksum,
    publish_checksum,
    publish_progress,
    run_validator,
)
from p2p_diloco.swarm.result import RoundResult
from p2p_diloco.swarm.state import SwarmState, download_state
from p2p_diloco.swarm.state_server import StateServer

__all__ = [
    "PeerProgress",
    "RoundAverager",
    "RoundResult",
    "StateServer",
    "SwarmConfig",
    "SwarmStartError",
    "SwarmState",
    "download_state",
    "ensure_identity",
    "fetch_checksums",
    "fetch_progress",
    "global_epoch",
    "install_validators",
    "run_validator",
    "layout_fingerprint",
    "majority_checksum",
    "params_sha256",
    "publish_checksum",
    "publish_progress",
    "start_dht",
    "visible_maddrs",
]
