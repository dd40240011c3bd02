#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite.
# Extra arguments go to pytest (for example: bash scripts/test.sh -k routing; -m "not slow" for the fast set).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$repo_root"
exec "$PY" -m pytest tests "$@"
