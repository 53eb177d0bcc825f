#!/usr/bin/env bash
# GPU run-book: every GPU path measured in one command, written to benchmarks/results/gpu_runbook.json
# (benchmarks/gpu_runbook.py says what each section measures).
#
#   bash benchmarks/gpu_runbook.sh               # on a machine with a CUDA GPU and the CUDA build of torch
#   bash benchmarks/gpu_runbook.sh --dry-run     # anywhere: tiny shapes on the CPU, checks the run-book only
#   bash benchmarks/gpu_runbook.sh --sections memory,swarm
#
# Without CUDA it runs the dry run (and says so): its JSON has "dry_run": true and no GPU figures.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
args=("$@")
if [[ " ${args[*]-} " != *" --dry-run "* ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_runbook: no CUDA device (or a CPU build of torch): running the dry run instead" >&2
  args+=(--dry-run)
fi
began=$(date +%s)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m benchmarks.gpu_runbook "${args[@]}"
echo "gpu_runbook: $(( $(date +%s) - began )) s"
