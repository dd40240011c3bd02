#!/usr/bin/env bash
# The README's main command: set up .venv if needed, then run the layer demo on the built-in
# small config (two runs, bitwise check, timings). Extra arguments go to scripts/demo.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$repo_root"
exec "$PY" scripts/demo.py --config configs/small.yaml "$@"
