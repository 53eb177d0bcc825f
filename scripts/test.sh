#!/usr/bin/env bash
# Set everything up, then run the whole test suite (about 16 minutes on 2 CPU cores; `-n 2 --dist loadfile` runs
# two files at a time in about 10, but some multi-process tests are then flaky on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
