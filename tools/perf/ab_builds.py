"""Two builds of the project side by side in one device call: a git ref ("A", e.g. main) and the
working tree ("B"), each with its own CUDA library and its own Python (a change that alters the
C ABI needs the Python of its own side).

On the CPU machine, before the device call (the libraries are built here, nvcc is here):

    python tools/perf/ab_builds.py prepare --base main            # into .gpu/ab (ignored by git)

writes ``.gpu/ab/base/`` (the ref's ``megatron_mok``, ``tools``, ``csrc`` and its library in
``lib/``), ``.gpu/ab/cand/lib/`` (the working tree's library) and ``.gpu/ab/manifest.json``.
Carry ``.gpu`` to the device machine, then run any command on both sides in a fixed order:

    python tools/perf/ab_builds.py run --order ABBA -- python3 tools/perf/backward_gemms.py --experts 48

Side A runs in ``.gpu/ab/base`` with that tree first on ``PYTHONPATH``, side B in the repository
root; each with ``MOK_LIBRARY`` set to its library. Every output line is prefixed with its run
("A1 ", "B2 ", ...); the exit status is the first failing run's, else 0. Relative paths in the
command resolve inside each side's tree, so a tool that exists only in the working tree runs on
side A only if the ref has it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".gpu" / "ab"
TREE_PATHS = ("megatron_mok", "tools", "csrc")
LIBRARY = "libmegatron_mok.so"


def parse_order(order: str) -> List[str]:
    """The sides of ``order`` ("ABBA", "AB", ...) in run order; only A and B, each at least once."""
    sides = list(order.upper())
    if not sides or set(sides) - {"A", "B"} or len(set(sides)) != 2:
        raise ValueError(f"--order must use both A and B and nothing else (e.g. ABBA), got {order!r}")
    return sides


def side_env(side: str, ab_dir: Path, root: Path = ROOT, env: Optional[Dict[str, str]] = None):
    """(working directory, environment) of a run on ``side``: A in the ref's tree, B in ``root``;
    that tree first on PYTHONPATH and MOK_LIBRARY its library."""
    env = dict(os.environ if env is None else env)
    tree = ab_dir / "base" if side == "A" else root
    lib = ab_dir / ("base" if side == "A" else "cand") / "lib" / LIBRARY
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root.resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + rest)
    env["MOK_LIBRARY"] = str(lib)
    return tree, env


def build_library(tree: Path, out: Path) -> None:
    """``python -m megatron_mok._build --out OUT`` with ``tree``'s package and its csrc/."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    subprocess.run([sys.executable, "-m", "megatron_mok._build", "--out", str(out)], cwd=tree, env=env,
                   check=True)


def prepare(base: str, ab_dir: Path, root: Path = ROOT,
            build: Callable[[Path, Path], None] = build_library) -> dict:
    """Export ``base``'s tree into ab_dir/base and build both sides' libraries; returns the
    manifest it writes (the ref, both commits, whether the working tree differs from HEAD)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True, text=True).stdout
    base_sha = git("rev-parse", "--verify", f"{base}^{{commit}}").strip()
    if ab_dir.exists():
        shutil.rmtree(ab_dir)
    (ab_dir / "base").mkdir(parents=True)
    archive = subprocess.run(["git", "archive", base_sha, *TREE_PATHS], cwd=root, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(ab_dir / "base")], input=archive.stdout, check=True)
    build(ab_dir / "base", ab_dir / "base" / "lib")
    build(root, ab_dir / "cand" / "lib")
    manifest = {"A": {"ref": base, "commit": base_sha},
                "B": {"commit": git("rev-parse", "HEAD").strip(),
                      "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}}
    (ab_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def run(order: Sequence[str], command: Sequence[str], ab_dir: Path, root: Path = ROOT, out=None) -> int:
    """Run ``command`` once per entry of ``order``, output lines prefixed with the run's label."""
    out = sys.stdout if out is None else out
    for side in "AB":
        lib = ab_dir / ("base" if side == "A" else "cand") / "lib" / LIBRARY
        if not lib.is_file():
            raise FileNotFoundError(f"side {side}: {lib} is missing (run `ab_builds.py prepare` first)")
    status, seen = 0, {"A": 0, "B": 0}
    for side in order:
        seen[side] += 1
        label = f"{side}{seen[side]}"
        cwd, env = side_env(side, ab_dir, root)
        proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            out.write(f"{label} {line}")
            out.flush()
        code = proc.wait()
        out.write(f"{label} exit {code}\n")
        if code and not status:
            status = code
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="export the ref's tree and build both libraries (CPU machine)")
    p.add_argument("--base", default="main", help="git ref of side A (default main)")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    r = sub.add_parser("run", help="run a command on both sides (device machine)")
    r.add_argument("--order", default="ABBA")
    r.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args(argv)
    if args.verb == "prepare":
        print(json.dumps(prepare(args.base, args.dir.resolve())))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("run needs a command after --")
    try:
        order = parse_order(args.order)
    except ValueError as err:
        ap.error(str(err))
    return run(order, command, args.dir.resolve())


if __name__ == "__main__":
    sys.exit(main())
