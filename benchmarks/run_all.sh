#!/usr/bin/env bash
# Every swarm benchmark end to end, as root: set-up if needed, the six benchmarks on the namespace testbed,
# then the BENCHMARKS.md tables and PNG plots. Prints how long each part took.
#
#   sudo bash benchmarks/run_all.sh            # or: sudo bash benchmarks/run_all.sh allreduce joiner
#
# The simulator's convergence benchmark (benchmarks/convergence.py) is separate: it is CPU-bound training,
# takes much longer, and its committed results are what the codec table's eval-loss column reads.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "run_all: the testbed creates network namespaces; run as root (sudo bash benchmarks/run_all.sh)" >&2
  exit 2
fi
began=$(date +%s)
bash scripts/setup.sh
set_up=$(( $(date +%s) - began ))
.venv/bin/python -m benchmarks.perf_swarm "${@:-all}"
.venv/bin/python -m benchmarks.perf_report
echo "run_all: set-up ${set_up} s, benchmarks and report $(( $(date +%s) - began - set_up )) s"
