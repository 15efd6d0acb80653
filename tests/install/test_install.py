"""The install keeps its promises (CPU only; no nvcc is run):

* a wheel without the CUDA library carries the sources (megatron_mok/csrc/), so the first use
  builds the library, and is py3-none-any; the install says so;
* a wheel with the library is tagged for its platform;
* an editable install does not rebuild a library built from the same sources and flags;
* the first use that builds the library says so; without nvcc it says what to install;
* the dependencies are what the package uses (no CUTLASS: nothing under csrc/ includes it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_mok import _build

ROOT = Path(__file__).resolve().parents[2]


def _source_tree(tmp_path: Path) -> Path:
    """A copy of what a wheel is built from: setup.py, README.md, the package (without a
    built library) and csrc/."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "lib", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "megatron_mok", src / "megatron_mok", ignore=ignore)
    shutil.copytree(ROOT / "csrc", src / "csrc", ignore=ignore)
    return src


def _wheel(src: Path, out: Path, **env) -> tuple[Path, str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], proc.stdout + proc.stderr


def test_a_wheel_without_the_library_carries_the_sources(tmp_path):
    src = _source_tree(tmp_path)
    wheel, log = _wheel(src, tmp_path / "dist", MOK_SKIP_CUDA_BUILD="1")
    assert wheel.name == "megatron_mok-0.1.0-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.endswith(".so") for n in names)
    sources = sorted(n for n in names if n.startswith("megatron_mok/csrc/src/") and n.endswith(".cu"))
    assert [Path(n).name for n in sources] == [p.name for p in _build.source_files(ROOT / "csrc")]
    assert any(n.startswith("megatron_mok/csrc/include/") for n in names)
    assert "the package carries csrc/, so the first use of a GPU backend builds it where nvcc exists" in log


def test_a_wheel_with_the_library_has_a_platform_tag(tmp_path):
    src = _source_tree(tmp_path)
    lib = src / "megatron_mok" / "lib"
    lib.mkdir()
    (lib / _build.LIBRARY_NAME).write_bytes(b"\x7fELF stand-in")  # current: the wheel takes it, no nvcc runs
    (lib / _build.BUILD_INFO_NAME).write_text(json.dumps({"source_hash": _build.source_hash(src / "csrc")}))
    wheel, log = _wheel(src, tmp_path / "dist")
    assert re.fullmatch(r"megatron_mok-0\.1\.0-py3-none-linux_[a-z0-9_]+\.whl", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_mok/lib/libmegatron_mok.so" in names and "megatron_mok/lib/build_info.json" in names
    assert re.search(r"megatron-mok: (the CUDA library in \S+ is current|using the current CUDA library of)", log), log
    metadata = zipfile.ZipFile(wheel).read("megatron_mok-0.1.0.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in metadata


def test_an_unchanged_library_is_not_rebuilt(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    out = tmp_path / "lib"
    built = []

    def fake_build(out_dir, *, csrc, **kwargs):
        built.append(out_dir)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / _build.LIBRARY_NAME).write_bytes(b"lib")
        (Path(out_dir) / _build.BUILD_INFO_NAME).write_text(json.dumps({"source_hash": _build.source_hash(csrc)}))
        return Path(out_dir) / _build.LIBRARY_NAME

    monkeypatch.setattr(_build, "build_library", fake_build)
    monkeypatch.setattr(_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.delenv("MOK_SKIP_CUDA_BUILD", raising=False)
    messages = []
    assert _build.install_library(out, csrc=csrc, log=messages.append) == "built"
    assert _build.install_library(out, csrc=csrc, log=messages.append) == "current"  # a second `pip install -e`
    assert len(built) == 1 and "is current (source hash" in messages[-1] and "not rebuilding" in messages[-1]
    (csrc / "src" / "common.cu").write_text((csrc / "src" / "common.cu").read_text() + "\n// changed\n")
    assert _build.install_library(out, csrc=csrc, log=messages.append) == "built"
    assert len(built) == 2
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    (csrc / "src" / "common.cu").write_text((csrc / "src" / "common.cu").read_text() + "\n// again\n")
    assert _build.install_library(out, csrc=csrc, log=messages.append) == "no-nvcc"
    assert "nvcc not found, installing without the CUDA library. The package carries csrc/" in messages[-1]


def test_the_first_use_that_builds_the_library_says_so(tmp_path, monkeypatch, capsys):
    from megatron_mok.ops import library

    monkeypatch.setenv("MOK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOK_LIBRARY", raising=False)
    monkeypatch.setattr(library, "_packaged_library", lambda: None)
    monkeypatch.setattr(_build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(_build, "build_library", lambda folder: (Path(folder) / _build.LIBRARY_NAME).write_bytes(b"x"))
    path = library.library_path()
    assert path.parent.name == _build.source_hash() and path.is_file()
    err = capsys.readouterr().err
    assert "megatron-mok: building the MoK CUDA library (first use of this version; a few minutes)" in err
    assert f"megatron-mok: built {path}" in err
    # Without nvcc the error says what to install.
    monkeypatch.setenv("MOK_CACHE_DIR", str(tmp_path / "cache2"))
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    with pytest.raises(library.LibraryUnavailable, match="nvcc was not found .* install the CUDA toolkit"):
        library.library_path()


def test_the_dependencies_are_what_the_package_uses():
    included = set()
    for path in (ROOT / "csrc").rglob("*"):
        if path.is_file():
            included |= set(re.findall(r'#include\s*[<"]([^>"]+)[>"]', path.read_text(errors="replace")))
    assert not any(i.startswith(("cutlass/", "cute/")) for i in included), "csrc/ includes CUTLASS"
    for name in ("requirements.txt", "setup.py", "megatron_mok/_build.py"):
        assert "cutlass" not in (ROOT / name).read_text().lower(), f"{name} still names CUTLASS"
    assert not any("cutlass" in flag.lower() for flag in _build.compile_flags())
