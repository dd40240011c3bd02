#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite in two processes.
# Extra arguments go to pytest (for example: bash scripts/test.sh -k routing; -m "not slow" for the fast set;
# tests/test_cli.py for one file).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$repo_root"
# The whole of tests/ unless a test path is given (bash scripts/test.sh tests/test_cli.py runs that file).
where=tests
for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then
    where=
  fi
done
# Two pytest-xdist workers (the dev extra installs it): on the 2-core machines CI runs on, the suite
# takes ~25 minutes instead of ~40. MOK_TEST_WORKERS=0 runs it in one process (for -x, --pdb, -s).
if "$PY" -c "import xdist" 2>/dev/null; then
  set -- -n "${MOK_TEST_WORKERS:-2}" "$@"
fi
exec "$PY" -m pytest $where "$@"
