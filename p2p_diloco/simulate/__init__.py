"""In-process simulator: k workers with real models and data on a virtual clock, driving the core."""

from p2p_diloco.simulate.engine import MODES, SimConfig, SimResult
from p2p_diloco.simulate.modes import run

__all__ = ["MODES", "SimConfig", "SimResult", "run"]
