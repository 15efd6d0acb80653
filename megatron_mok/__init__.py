"""megatron-mok: MoE dispatch, expert FFN and combine in one persistent CUDA kernel, as a
Megatron-Core plugin.

* :func:`megatron_mok.functional.mok_moe`: the functional entry point (no Megatron needed).
* :class:`MoKConfig`: the tunables.
* :func:`register`: makes ``--moe-token-dispatcher-type mok`` available in Megatron-Core.
"""

from .config import MegakernelTunables, MoKConfig, MoKConfigError

__version__ = "0.1.0"
__all__ = ["MoKConfig", "MegakernelTunables", "MoKConfigError", "register", "__version__"]


def register() -> None:
    """Install the ``mok`` dispatcher into Megatron-Core (idempotent). See
    :func:`megatron_mok.megatron.register`."""
    from .megatron import register as _register

    _register()
