#!/usr/bin/env bash
# Set everything up, then run the demo on the embedded defaults (tiny model, embedded corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m p2p_diloco.demo "$@"
