"""Shared pytest setup: GPU tests skip with a printed reason where there is no sm_90 GPU; the
library fixtures of the C ABI tests."""

import os

# Virtual EP ranks (LocalEPGroup) spin-wait on each other in one CUDA context: kernels must be
# loaded eagerly (see megatron_mok/functional/groups.py). Set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_mok import _build  # noqa: E402
from megatron_mok.ops import library  # noqa: E402


def gpu_skip_reason(min_gpus: int = 1):
    """None when ``min_gpus`` sm_90 GPUs are present, else why GPU tests are skipped."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on the H200 device machine)"
    if torch.cuda.device_count() < min_gpus:
        return f"needs {min_gpus} GPUs, this machine has {torch.cuda.device_count()}"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        return f"the MoK kernels need sm_90 (H100/H200), this GPU is sm_{major}{minor}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs one sm_90 GPU")
    config.addinivalue_line("markers", "gpu2: needs two sm_90 GPUs")
    config.addinivalue_line("markers", "gpun: one process per GPU on every GPU (at least two sm_90 GPUs)")


def pytest_collection_modifyitems(config, items):
    reasons = {"gpu": gpu_skip_reason(1), "gpu2": gpu_skip_reason(2), "gpun": gpu_skip_reason(2)}
    for item in items:
        for mark, reason in reasons.items():
            if reason is not None and item.get_closest_marker(mark) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The library of this checkout (the cache's build when it is current, else a fresh one)."""
    if _build.find_nvcc() is None:
        pytest.skip("nvcc not found: the CUDA library cannot be compiled on this machine")
    try:
        path = library.library_path()
    except library.LibraryUnavailable:
        path = _build.build_library(tmp_path_factory.mktemp("moklib"))
    return library.MokLibrary(path)


@pytest.fixture
def use_lib(lib, monkeypatch):
    """``lib`` as the process's library for the test."""
    monkeypatch.setattr(library, "_library", lib)
    return lib
