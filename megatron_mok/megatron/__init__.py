"""Megatron-Core integration of MoK: ``--moe-token-dispatcher-type mok``.

* :func:`register`: one idempotent call that makes ``mok`` a dispatcher type (flag, ``--mok-*``
  tunables, every ``MoELayer`` built with it becomes a :class:`MoKMoELayer`).
* :class:`MoKMoELayer`: Megatron's router feeding the fused ``mok_moe`` dispatch + experts +
  combine, with Megatron's parameter layout.
* :class:`MoKLayerSettings`: backend, tunables and shared-expert fusion of the layer.
* :class:`MoKTokenDispatcher`: Megatron's six-method dispatcher protocol on the MoK dataflow.

See docs/megatron.md. Requires megatron-core 0.19.2.
"""

from .arguments import add_mok_arguments, settings_from_args
from .dispatcher import MoKTokenDispatcher
from .layer import MOK_DISPATCHER_TYPE, MoKMoELayer
from .peers import EPTopologyError
from .registration import is_registered, register
from .settings import MoKLayerSettings, settings_for
from .validation import MoKUnsupportedError, check_supported, unsupported_settings

__all__ = [
    "register",
    "is_registered",
    "MoKMoELayer",
    "MoKTokenDispatcher",
    "MoKLayerSettings",
    "MoKUnsupportedError",
    "EPTopologyError",
    "MOK_DISPATCHER_TYPE",
    "add_mok_arguments",
    "settings_from_args",
    "settings_for",
    "check_supported",
    "unsupported_settings",
]
