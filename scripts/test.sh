#!/usr/bin/env bash
# Set everything up, then run the whole test suite. CI passes `-n 2 --dist loadfile` (two test files at a time:
# about 10 minutes on 2 CPU cores; about 16 one file at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
