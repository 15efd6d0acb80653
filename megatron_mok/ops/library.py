"""Finding, building and loading the MoK CUDA library, and calling into it.

Search order of :func:`load_library`:

1. ``$MOK_LIBRARY`` (a path to ``libmegatron_mok.so``), if set: used as is;
2. ``megatron_mok/lib/libmegatron_mok.so`` built by ``setup.py``, when its recorded source
   hash matches the sources (``csrc/`` of a checkout, ``megatron_mok/csrc/`` of a wheel; a
   library without sources beside it is used as is);
3. the cache ``$MOK_CACHE_DIR`` (default ``~/.cache/megatron_mok``)/<source hash>/;
4. a build into that cache folder with nvcc (a file lock keeps concurrent ranks to one build;
   the process that builds says so on stderr, the build takes minutes).

Loading needs no GPU; launching does. Each kernel family's Python module declares the C
signatures it calls with :meth:`MokLibrary.function`.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
import threading
from pathlib import Path
from typing import Optional

from .. import _build

ABI_VERSION = 6
_lock = threading.Lock()
_library: Optional["MokLibrary"] = None


class LibraryUnavailable(RuntimeError):
    """The MoK CUDA library could not be found, built or loaded; the message says why."""


class MokKernelError(RuntimeError):
    """A MoK C entry point returned an error code."""


class MokLibrary:
    """The loaded ``libmegatron_mok.so`` with checked calls."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._functions = {}
        try:
            self._dll = ctypes.CDLL(str(self.path))
        except OSError as err:
            raise LibraryUnavailable(f"cannot load {self.path}: {err}") from err
        self._dll.mok_error_string.restype = ctypes.c_char_p
        self._dll.mok_error_string.argtypes = [ctypes.c_int]
        self._dll.mok_abi_version.restype = ctypes.c_int
        version = self._dll.mok_abi_version()
        if version != ABI_VERSION:
            raise LibraryUnavailable(
                f"{self.path} has ABI version {version}, this package needs {ABI_VERSION}; "
                "rebuild it (python -m megatron_mok._build)"
            )

    def function(self, name: str, restype, argtypes):
        """The C function ``name`` with its signature set (the first signature given for a name
        is kept: setting ctypes signatures costs host time on every call of a layer)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = getattr(self._dll, name)
            fn.restype = restype
            fn.argtypes = argtypes
            self._functions[name] = fn
        return fn

    def check(self, code: int, what: str) -> None:
        """Raise :class:`MokKernelError` naming ``what`` when ``code`` is not MOK_OK."""
        if code != 0:
            message = self._dll.mok_error_string(code).decode()
            raise MokKernelError(f"{what} failed: {message} (code {code})")


def cache_root() -> Path:
    """Folder of cached builds: ``$MOK_CACHE_DIR`` or ``~/.cache/megatron_mok``."""
    return Path(os.environ.get("MOK_CACHE_DIR", Path.home() / ".cache" / "megatron_mok"))


def _packaged_library() -> Optional[Path]:
    lib_dir = _build.PACKAGE_DIR / "lib"
    lib = lib_dir / _build.LIBRARY_NAME
    if not lib.is_file():
        return None
    if not _build.CSRC_DIR.is_dir():
        return lib  # no sources to compare against (an older wheel): use it as it is
    return lib if _build.library_is_current(lib_dir) else None


def _cached_or_built_library() -> Path:
    if not _build.CSRC_DIR.is_dir():
        raise LibraryUnavailable(
            f"the package has no built library and no CUDA sources to build one from ({_build.CSRC_DIR} "
            "is missing); reinstall megatron-mok from a checkout or a wheel of this version"
        )
    folder = cache_root() / _build.source_hash()
    lib = folder / _build.LIBRARY_NAME
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if not lib.is_file():
                if _build.find_nvcc() is None:
                    raise _build.BuildError(
                        "nvcc was not found (looked at $MOK_NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin) and "
                        "this installation has no built library; install the CUDA toolkit (12.8 or newer, for "
                        "sm_90a) or set CUDA_HOME, then run again (or `python -m megatron_mok._build`)")
                print(f"megatron-mok: building the MoK CUDA library (first use of this version; a few minutes) "
                      f"into {folder} with {_build.find_nvcc()}", file=sys.stderr, flush=True)
                _build.build_library(folder)
                print(f"megatron-mok: built {lib}", file=sys.stderr, flush=True)
        except _build.BuildError as err:
            raise LibraryUnavailable(f"building the MoK CUDA library failed: {err}") from err
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return lib


def library_path() -> Path:
    """Where the library to load is, building it into the cache if needed."""
    override = os.environ.get("MOK_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise LibraryUnavailable(f"$MOK_LIBRARY={override} does not exist")
        return Path(override)
    packaged = _packaged_library()
    if packaged is not None:
        return packaged
    return _cached_or_built_library()


def load_library() -> MokLibrary:
    """The process-wide :class:`MokLibrary` (found, built if needed, and loaded once).

    Raises:
        LibraryUnavailable: with what is missing (nvcc, sources) or what failed.
    """
    global _library
    with _lock:
        if _library is None:
            _library = MokLibrary(library_path())
        return _library
