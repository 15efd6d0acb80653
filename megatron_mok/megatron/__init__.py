"""Megatron-Core integration of MoK: ``--moe-token-dispatcher-type mok``.

* :func:`register`: one idempotent call that makes ``mok`` a dispatcher type (flag, ``--mok-*``
  tunables, every ``MoELayer`` built with it becomes a :class:`MoKMoELayer`).
* :class:`MoKMoELayer`: Megatron's router feeding the fused ``mok_moe`` dispatch + experts +
  combine, with Megatron's parameter layout.
* :class:`MoKLayerSettings`: backend, tunables and shared-expert fusion of the layer.
* :class:`MoKTokenDispatcher`: Megatron's six-method dispatcher protocol on the MoK dataflow.

Modules, one job each (imports go one way: ``settings`` <- ``arguments`` <- ``layer`` <-
``registration`` <- ``pretrain``):

* ``settings``: :class:`MoKLayerSettings`; ``arguments``: the ``--mok-*`` flags and where a
  layer finds its settings; ``validation``: settings MoK does not support, with reasons;
  ``backend_choice``: which backend the MoE layers run and why (no silent slow path);
  ``peers``: the EP groups' NVLink domain (NVML fabric information) and peer access;
  ``startup``: what ``validate_args`` checks, before and after Megatron's own checks;
* ``routing``: router output to top-k ids/weights; ``experts``: the weights of Megatron's
  expert modules; ``stacking``: those weights as zero-copy [L, ...] tensors;
* ``layer``: :class:`MoKMoELayer`; ``dispatcher``: :class:`MoKTokenDispatcher`;
  ``registration``: :func:`register`;
* the launcher (``python -m megatron_mok.pretrain_gpt``): ``pretrain`` (entry and CPU path),
  ``gpt_recipe`` (Megatron-LM's GPT batches, loss, datasets), ``arg_files`` (``@FILE``
  arguments);
* ``training_log``: reading Megatron's training log (benchmarks, log comparison);
  ``cpu_compat``: Megatron's MoE code on a CPU (tests, CPU demo, the launcher without a GPU).

Only this package and :mod:`megatron_mok.bench` import Megatron. See docs/megatron.md.
Requires megatron-core 0.19.2.
"""

from .arguments import add_mok_arguments, settings_for, settings_from_args
from .backend_choice import BackendChoice, MoKBackendError, choose_backend
from .dispatcher import MoKTokenDispatcher
from .layer import MOK_DISPATCHER_TYPE, MoKMoELayer
from .peers import EPTopologyError
from .registration import is_registered, register
from .settings import MoKLayerSettings
from .validation import MoKUnsupportedError, check_supported, unsupported_settings

__all__ = [
    "register",
    "is_registered",
    "MoKMoELayer",
    "MoKTokenDispatcher",
    "MoKLayerSettings",
    "MoKUnsupportedError",
    "EPTopologyError",
    "MoKBackendError",
    "BackendChoice",
    "choose_backend",
    "MOK_DISPATCHER_TYPE",
    "add_mok_arguments",
    "settings_from_args",
    "settings_for",
    "check_supported",
    "unsupported_settings",
]
