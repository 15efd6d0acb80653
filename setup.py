"""pip-installable megatron-mok. Builds libmegatron_mok.so from csrc/ with nvcc for sm_90a
when nvcc is present; without nvcc it installs the pure-Python parts and the library is built
on first use (or the reference backend is used)."""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_build_module():
    spec = importlib.util.spec_from_file_location("_mok_build", ROOT / "megatron_mok" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithLibrary(build_py):
    """build_py that also compiles the CUDA library into megatron_mok/lib/."""

    def run(self):
        super().run()
        if os.environ.get("MOK_SKIP_CUDA_BUILD") == "1":
            print("megatron-mok: MOK_SKIP_CUDA_BUILD=1, not building the CUDA library")
            return
        build = _load_build_module()
        if build.find_nvcc() is None:
            print("megatron-mok: nvcc not found; installing without the CUDA library "
                  "(it is built on first use where nvcc exists)", file=sys.stderr)
            return
        editable = getattr(self, "editable_mode", False)
        out = ROOT / "megatron_mok" / "lib" if editable else Path(self.build_lib) / "megatron_mok" / "lib"
        print(f"megatron-mok: building the CUDA library into {out}")
        build.build_library(out, csrc=ROOT / "csrc")


setup(
    name="megatron-mok",
    version="0.1.0",
    description="Megatron-Core MoE plugin: dispatch, expert FFN and combine in one persistent CUDA kernel",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mok", "megatron_mok.*"]),
    package_data={"megatron_mok": ["lib/*.so", "lib/*.json"]},
    install_requires=["torch>=2.9", "numpy"],
    extras_require={
        "megatron": ["megatron-core==0.19.2"],
        "cutlass": ["nvidia-cutlass==4.2.0.0"],
        "bench": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "matplotlib"],
    },
    entry_points={"console_scripts": [
        "mok-pretrain-gpt=megatron_mok.pretrain_gpt:main",
        "mok-bench=megatron_mok.bench.__main__:main",
    ]},
    cmdclass={"build_py": BuildPyWithLibrary},
)
