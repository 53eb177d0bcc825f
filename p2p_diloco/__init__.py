"""p2p_diloco: DiLoCo training over a hivemind swarm of volunteer peers."""

__version__ = "0.1.0"
