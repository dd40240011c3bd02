# Sourced by the README's commands: create or reuse .venv (Python 3.12) with mok_plugin installed.
# Re-installs only when setup.cfg or pyproject.toml changed since the last install.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MOK_PLUGIN_VENV:-$repo_root/.venv}"
extras="${MOK_PLUGIN_EXTRAS:-dev}"
if [ ! -x "$venv/bin/python" ]; then
  python_bin="$(command -v python3.12 || true)"
  if [ -z "$python_bin" ]; then
    echo "error: python3.12 not found; install Python 3.12 (pyenv: 'pyenv install 3.12') and retry" >&2
    exit 1
  fi
  echo "==> creating $venv with $("$python_bin" --version)"
  "$python_bin" -m venv "$venv"
fi
stamp="$venv/.mok_plugin_installed"
want="$(cat "$repo_root/setup.cfg" "$repo_root/pyproject.toml" | sha256sum | cut -d' ' -f1) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing mok_plugin[$extras] into $venv (first time: torch is a few GB, about 2 minutes)"
  # The CUDA build of torch and its libraries take ~6 GB in the venv, and pip unpacks them first.
  free_kib="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((10 * 1024 * 1024)) ]; then
    echo "warning: $((free_kib / 1024)) MiB free under $(dirname "$venv"); the install needs about 10 GiB" >&2
  fi
  log="$venv/install.log"
  # Two steps: DeepSpeed ships an sdist whose setup.py imports torch, so torch goes in first.
  # DS_BUILD_OPS=0: a pure-Python DeepSpeed; its ops compile on first use if ever needed.
  if ! { "$venv/bin/python" -m pip install --upgrade pip && "$venv/bin/python" -m pip install -e "$repo_root" &&
         DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -e "$repo_root[$extras]"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "error: installing mok_plugin[$extras] failed; full log in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
PY="$venv/bin/python"
export PY
