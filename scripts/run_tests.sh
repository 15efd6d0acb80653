#!/usr/bin/env bash
# The test command: sets up the environment from nothing (or reuses it) and runs the suite.
# GPU tests skip with a printed reason where there is no sm_90 GPU. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/ensure_env.sh" | tail -n 1)
cd "$root"
exec "$python" -m pytest -rs --timeout=900 tests "$@"
