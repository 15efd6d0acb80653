"""pip-installable megatron-mok.

The CUDA library (libmegatron_mok.so, sm_90a, C ABI) is built from csrc/ with nvcc at install
time when nvcc is present:

* ``pip install -e .`` builds it into megatron_mok/lib/, and skips the build when the library
  there was built from the same sources with the same flags (the source hash that
  megatron_mok/lib/build_info.json records);
* a wheel (``pip wheel .`` / ``pip install .``) takes the source tree's library when it is
  current, else builds one; a wheel with the library is tagged for its platform
  (py3-none-linux_x86_64), one without is py3-none-any;
* every wheel carries the sources (megatron_mok/csrc/), so one built without nvcc (or with
  ``MOK_SKIP_CUDA_BUILD=1``) builds the library on first use where nvcc exists, and says so.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


def _load_build_module():
    spec = importlib.util.spec_from_file_location("_mok_build", ROOT / "megatron_mok" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log(message):
    print(message, file=sys.stderr, flush=True)


class BuildPyWithLibrary(build_py):
    """build_py that also puts the CUDA library into megatron_mok/lib/ (and, for a wheel, the
    sources into megatron_mok/csrc/)."""

    def run(self):
        super().run()
        build = _load_build_module()
        csrc = ROOT / "csrc"
        if getattr(self, "editable_mode", False):
            build.install_library(ROOT / "megatron_mok" / "lib", csrc=csrc, log=_log)
            return
        package = Path(self.build_lib) / "megatron_mok"
        shutil.copytree(csrc, package / "csrc", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.o", "__pycache__"))
        lib = package / "lib"
        if not build.library_is_current(lib, csrc):  # package_data copied a stale library: never ship it
            for name in (build.LIBRARY_NAME, build.BUILD_INFO_NAME):
                (lib / name).unlink(missing_ok=True)
        build.install_library(lib, csrc=csrc, reuse_from=ROOT / "megatron_mok" / "lib", log=_log)


class BdistWheelWithLibrary(bdist_wheel):
    """A wheel holding the CUDA library is platform-specific (py3-none-<platform>: the library
    has a C ABI, so any Python 3 loads it); one without stays py3-none-any."""

    def run(self):
        if not self.skip_build:
            self.run_command("build")
        build_lib = Path(self.get_finalized_command("build_py").build_lib)
        self.root_is_pure = not (build_lib / "megatron_mok" / "lib" / "libmegatron_mok.so").is_file()
        if not self.root_is_pure:  # the install step puts the package in platlib, as for extensions
            self.distribution.has_ext_modules = lambda: True
        super().run()

    def get_tag(self):
        impl, abi, plat = super().get_tag()
        if not self.root_is_pure:
            return "py3", "none", plat
        return impl, abi, plat


setup(
    name="megatron-mok",
    version="0.1.0",
    description="Megatron-Core MoE plugin: dispatch, expert FFN and combine in one persistent CUDA kernel",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mok", "megatron_mok.*"]),
    package_data={"megatron_mok": ["lib/*.so", "lib/*.json"]},
    install_requires=["torch>=2.9"],
    extras_require={
        "megatron": ["megatron-core==0.19.2", "psutil"],
        "bench": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "matplotlib"],
    },
    entry_points={"console_scripts": [
        "mok-pretrain-gpt=megatron_mok.pretrain_gpt:main",
        "mok-bench=megatron_mok.bench.__main__:main",
    ]},
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": BdistWheelWithLibrary},
)
