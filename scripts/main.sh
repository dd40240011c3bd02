#!/usr/bin/env bash
# The README's main command: set up .venv if needed, then compare Megatron's stock MoE layers with
# MoK on the tiny built-in config (scripts/compare.py: tokens/s, memory, losses, bitwise checks;
# a report, a plot and the frameworks' log under out/compare/megatron/). Extra arguments go to
# scripts/compare.py (--framework deepspeed writes to out/compare/deepspeed/).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$repo_root"
exec "$PY" scripts/compare.py --config configs/topologies/tiny_cpu.yaml "$@"
