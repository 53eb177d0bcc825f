"""``peer.py`` with ``quorum.STEP_BACK_LEAD_S`` from the spec's ``step_back_lead_s`` (set before the averager
process forks, so its ``EarlyAssembly`` reads it). Usage: python tests/swarm_helpers/step_back_peer.py SPEC.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import peer  # this folder is sys.path[0] when run as a script

from p2p_diloco.swarm import quorum

if __name__ == "__main__":
    lead = json.loads(Path(sys.argv[1]).read_text()).get("step_back_lead_s")
    if lead is not None:
        quorum.STEP_BACK_LEAD_S = float(lead)
    peer.main()
