"""The tools' tests: ``python -m pytest tools/perf/tests`` from the repository root (not part of
``pytest tests``). The tools are scripts, not a package: their folder goes on the import path,
as it does when one of them runs."""

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
ROOT = TOOLS.parents[1]
for path in (str(ROOT), str(TOOLS)):
    if path not in sys.path:
        sys.path.insert(0, path)
