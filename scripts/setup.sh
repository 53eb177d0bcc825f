#!/usr/bin/env bash
# Create the project-local virtual environment in .venv and install p2p_diloco with its dev tools.
# Safe to run again: it reinstalls only when pyproject.toml changed.
#
# torch: on a machine without an NVIDIA GPU we pin the CPU build torch==2.13.0 from PyTorch's CPU
# index, so set-up does not pull a multi-GB CUDA build. With a GPU (nvidia-smi answers), plain PyPI
# torch is the CUDA build. Override the index with TORCH_INDEX_URL, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup: Python >= 3.10 is required (found: $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=.venv/.p2p_diloco-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install torch --extra-index-url "$TORCH_INDEX_URL"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install torch
  else
    cpu_index=https://download.pytorch.org/whl/cpu
    if .venv/bin/python -c "import urllib.request as u; u.urlopen('$cpu_index/', timeout=10)" 2>/dev/null; then
      "${PIP[@]}" install "torch==2.13.0" --extra-index-url "$cpu_index"
    else
      # No route to PyTorch's index (a mirror-only network): take torch==2.13.0 from the configured
      # indexes or find-links, which on such machines carry the CPU build.
      "${PIP[@]}" install "torch==2.13.0"
    fi
  fi
fi
"${PIP[@]}" install -e ".[dev]"
echo "$want" > "$stamp"
