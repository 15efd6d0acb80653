#!/usr/bin/env bash
# Creates (once) and updates the project's virtual environment outside the clone, installs
# every dependency and this package (editable, building the CUDA library when nvcc exists).
# Prints the venv's python path on its last line. Reused by later runs: a stamp file skips
# the pip steps when nothing changed.
#   MOK_VENV           where the venv lives (default: ~/.venvs/megatron-mok)
#   MOK_PYTHON         the Python 3.12 interpreter to create it with (default: found below)
#   MOK_SYSTEM_PYTHON  use this interpreter as it is, with no venv and no downloads (machines
#                      without a package index that already have torch and megatron-core,
#                      like the H200 test machines): only this package's CUDA library is built
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -n "${MOK_SYSTEM_PYTHON:-}" ]; then
  "$MOK_SYSTEM_PYTHON" -c 'import torch, megatron.core' >&2 || {
    echo "error: MOK_SYSTEM_PYTHON=$MOK_SYSTEM_PYTHON lacks torch or megatron-core" >&2; exit 1; }
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  if [ -z "${MOK_LIBRARY:-}" ]; then
    (cd "$root" && "$MOK_SYSTEM_PYTHON" -c 'from megatron_mok.ops.library import load_library; load_library()') >&2
  fi
  echo "$MOK_SYSTEM_PYTHON"
  exit 0
fi
venv=${MOK_VENV:-$HOME/.venvs/megatron-mok}

find_python312() {
  if [ -n "${MOK_PYTHON:-}" ]; then echo "$MOK_PYTHON"; return; fi
  if python3.12 -c 'import sys' >/dev/null 2>&1; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  for p in /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  echo "error: Python 3.12 not found (megatron-core 0.19.2 needs it); set MOK_PYTHON" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python312)
  echo "creating venv $venv with $py" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.megatron-mok-stamp"
want=$(cat "$root/requirements.txt" "$root/setup.py" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" >&2
  echo "$want" > "$stamp"
fi
# The editable install is cheap and rebuilds the CUDA library when csrc/ changed.
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e "$root" >&2
echo "$venv/bin/python"
