"""Building the MoK CUDA library (``libmegatron_mok.so``) from ``csrc/`` with nvcc.

Imports nothing but the standard library, so ``setup.py`` can use it before torch exists.
The library has a C ABI and includes no PyTorch headers: every ``csrc/src/*.cu`` compiles on
its own (in parallel) and links into one shared object for sm_90a.

Used by ``setup.py`` (install time: :func:`install_library`) and by
:mod:`megatron_mok.ops.library` (first use, into a cache folder keyed by the hash of the sources
and flags). Also a command: ``python -m megatron_mok._build [--out DIR]``.

The sources are ``csrc/`` beside the package in a source checkout (and an editable install), or
``megatron_mok/csrc/`` inside an installed wheel: every wheel carries them, so that a wheel built
without nvcc can build the library on first use where nvcc exists.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

LIBRARY_NAME = "libmegatron_mok.so"
BUILD_INFO_NAME = "build_info.json"
PACKAGE_DIR = Path(__file__).resolve().parent


def _find_csrc() -> Path:
    inside = PACKAGE_DIR / "csrc"  # an installed wheel carries them in the package
    return inside if (inside / "src").is_dir() else PACKAGE_DIR.parent / "csrc"


CSRC_DIR = _find_csrc()
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


class BuildError(RuntimeError):
    """nvcc is missing or a compile step failed; the message holds nvcc's output."""


def find_nvcc() -> Optional[str]:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc``, then PATH, then /usr/local/cuda; or None."""
    candidates = []
    for var in ("MOK_NVCC", "CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            candidates.append(value if var == "MOK_NVCC" else os.path.join(value, "bin", "nvcc"))
    which = shutil.which("nvcc")
    if which:
        candidates.append(which)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def source_files(csrc: Path = CSRC_DIR) -> List[Path]:
    """The translation units of the library, sorted."""
    return sorted((csrc / "src").glob("*.cu"))


def compile_flags(csrc: Path = CSRC_DIR) -> List[str]:
    """nvcc flags shared by every translation unit."""
    return [
        "-O3", "-std=c++17", GENCODE, "-Xcompiler=-fPIC,-fvisibility=hidden",
        "--expt-relaxed-constexpr", "-lineinfo", f"-I{csrc / 'include'}",
    ]


def source_hash(csrc: Path = CSRC_DIR) -> str:
    """Hash of every file under csrc/ and of the flags: the key of a cached build."""
    h = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(csrc)).encode())
        h.update(path.read_bytes())
    h.update(" ".join(f for f in compile_flags(csrc) if not f.startswith("-I")).encode())
    return h.hexdigest()[:16]


def build_library(out_dir: Path, *, csrc: Path = CSRC_DIR, jobs: Optional[int] = None,
                  verbose: bool = False) -> Path:
    """Compile ``csrc/src/*.cu`` and link ``out_dir/libmegatron_mok.so``.

    Writes ``build_info.json`` beside it (source hash, nvcc, flags). The library is written to
    a temporary name and renamed, so concurrent builders never load a half-written file.

    Raises:
        BuildError: nvcc not found, or a compile/link step failed (its output included).
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(
            "nvcc was not found (looked at $MOK_NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin); "
            "install the CUDA toolkit (12.8 or newer, for sm_90a) or set CUDA_HOME"
        )
    sources = source_files(csrc)
    if not sources:
        raise BuildError(f"no CUDA sources under {csrc / 'src'}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = compile_flags(csrc)
    jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="mok-build-") as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in sources]

        def compile_one(pair):
            src, obj = pair
            cmd = [nvcc, *flags, "-c", str(src), "-o", str(obj)]
            return src, _run(cmd, verbose)

        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for src, (code, output) in pool.map(compile_one, zip(sources, objects)):
                if code != 0:
                    raise BuildError(f"nvcc failed on {src.name}:\n{output}")
        tmp_lib = out_dir / f".{LIBRARY_NAME}.{os.getpid()}.tmp"
        code, output = _run([nvcc, GENCODE, "-shared", *map(str, objects), "-o", str(tmp_lib)], verbose)
        if code != 0:
            raise BuildError(f"linking {LIBRARY_NAME} failed:\n{output}")
        os.replace(tmp_lib, out_dir / LIBRARY_NAME)
    info = {"source_hash": source_hash(csrc), "nvcc": nvcc, "flags": flags,
            "sources": [s.name for s in sources]}
    (out_dir / BUILD_INFO_NAME).write_text(json.dumps(info, indent=1))
    return out_dir / LIBRARY_NAME


def recorded_hash(lib_dir: Path) -> Optional[str]:
    """The source hash ``build_info.json`` in ``lib_dir`` records for the library beside it, or
    None when either is missing or unreadable."""
    lib_dir = Path(lib_dir)
    if not (lib_dir / LIBRARY_NAME).is_file():
        return None
    try:
        return json.loads((lib_dir / BUILD_INFO_NAME).read_text())["source_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def library_is_current(lib_dir: Path, csrc: Path = CSRC_DIR) -> bool:
    """Whether ``lib_dir`` holds a library built from these sources with these flags."""
    return recorded_hash(lib_dir) == source_hash(csrc)


def install_library(out_dir: Path, *, csrc: Path = CSRC_DIR, reuse_from: Optional[Path] = None,
                    log=print) -> str:
    """What ``setup.py`` does for the library: build it into ``out_dir`` unless a current one is
    already there (an editable install run again with unchanged sources and flags) or in
    ``reuse_from`` (the source tree's, copied into a wheel); without nvcc, install without it.

    Returns:
        "current", "copied", "built", "skipped" (``MOK_SKIP_CUDA_BUILD=1``) or "no-nvcc".

    Raises:
        BuildError: a compile or link step failed.
    """
    out_dir = Path(out_dir)
    if library_is_current(out_dir, csrc):
        log(f"megatron-mok: the CUDA library in {out_dir} is current (source hash {source_hash(csrc)}), "
            "not rebuilding it")
        return "current"
    if os.environ.get("MOK_SKIP_CUDA_BUILD") == "1":
        log("megatron-mok: MOK_SKIP_CUDA_BUILD=1, installing without the CUDA library; the package "
            "carries csrc/, so the first use of a GPU backend builds it where nvcc exists")
        return "skipped"
    if reuse_from is not None and Path(reuse_from).resolve() != out_dir.resolve() and library_is_current(reuse_from, csrc):
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in (LIBRARY_NAME, BUILD_INFO_NAME):
            shutil.copy2(Path(reuse_from) / name, out_dir / name)
        log(f"megatron-mok: using the current CUDA library of {reuse_from} (source hash {source_hash(csrc)})")
        return "copied"
    if find_nvcc() is None:
        log("megatron-mok: nvcc not found, installing without the CUDA library. The package carries "
            "csrc/: the first use of a GPU backend builds the library with nvcc (CUDA 12.8 or newer) into "
            "~/.cache/megatron_mok (or $MOK_CACHE_DIR); where there is no nvcc, only the reference backend "
            "runs (`python -m megatron_mok._build` builds it by hand)")
        return "no-nvcc"
    log(f"megatron-mok: building the CUDA library into {out_dir} (a few minutes)")
    build_library(out_dir, csrc=csrc)
    return "built"


def _run(cmd: List[str], verbose: bool):
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if verbose and proc.stdout:
        print(proc.stdout, flush=True)
    return proc.returncode, proc.stdout


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Build the MoK CUDA library with nvcc.")
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR / "lib",
                        help="output folder (default: the package's lib/)")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    path = build_library(args.out, jobs=args.jobs, verbose=args.verbose)
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
