"""``run_peer`` as a peer of another protocol version: a release before or after this one, as far as the names
peers meet under are concerned (``p2p_diloco.swarm.protocol``).

Usage: python tests/swarm_helpers/old_release.py VERSION RUN_PEER_ARGS...

The protocol module is loaded first, from its own source with ``PROTOCOL_VERSION`` set to ``VERSION``, and put
in ``sys.modules`` before anything else of the package is imported, so every name, key, default argument and
record field derived from the version (progress and checksum keys, the averager's prefix, the records'
``protocol`` field and schema) is that version's, exactly as a release that shipped it would spell them. The
rest is this release's code: what a rolling upgrade exercises is whether peers of two versions meet, refuse
each other or ban each other, and that is decided by these names and fields. No product flag: the version is
a constant of a release, not a setting.
"""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
import types
from pathlib import Path


def load_protocol(version: int) -> types.ModuleType:
    spec = importlib.util.find_spec("p2p_diloco")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "swarm" / "protocol.py"
    source, count = re.subn(r"^PROTOCOL_VERSION = \d+$", f"PROTOCOL_VERSION = {version}", path.read_text(),
                            flags=re.MULTILINE)
    assert count == 1, f"{path} no longer defines PROTOCOL_VERSION on one line"
    module = types.ModuleType("p2p_diloco.swarm.protocol")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the project's own source file
    sys.modules[module.__name__] = module
    return module


if __name__ == "__main__":
    load_protocol(int(sys.argv.pop(1)))
    sys.argv[0] = "run_peer"
    runpy.run_module("p2p_diloco.cli.run_peer", run_name="__main__", alter_sys=True)
