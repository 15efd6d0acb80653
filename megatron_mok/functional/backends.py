"""The ordered registry of backends, and which one runs a ``mok_moe`` call.

``auto`` takes the first backend of :data:`REGISTRY` that runs the call: the ``megakernel``
(sm_90 GPU, bf16, a shape it supports), else ``cuda``, else ``reference``. The two GPU backends
give bitwise the same outputs and gradients (the megakernel's backward is the cuda backend's). A
backend named explicitly that cannot run raises :class:`BackendUnavailable` with the reason;
``auto`` on a CUDA device logs one line with the reasons when it does not take the first.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, Tuple

from .backend import Backend, BackendUnavailable, CallSpec, gpu_unavailable_reason
from .cuda_backend import CudaBackend
from .megakernel_backend import MegakernelBackend
from .reference_backend import ReferenceBackend

__all__ = ["REGISTRY", "Backend", "BackendUnavailable", "CallSpec", "backend_named", "gpu_unavailable_reason",
           "select_backend"]

log = logging.getLogger("megatron_mok")

REGISTRY: Tuple[Backend, ...] = (MegakernelBackend(), CudaBackend(), ReferenceBackend())
"""Every backend, fastest first: the order ``auto`` tries them in."""

_BY_NAME: Dict[str, Backend] = {b.name: b for b in REGISTRY}


def backend_named(name: str) -> Backend:
    """The backend called ``name`` (one of :data:`REGISTRY`'s names)."""
    return _BY_NAME[name]


def select_backend(requested: str, spec: CallSpec) -> Backend:
    """The backend that runs a call: ``requested`` itself, or for "auto" the first of
    :data:`REGISTRY` that can.

    Raises:
        BackendUnavailable: ``requested`` names a backend that cannot run the call, with why.
    """
    if requested != "auto":
        backend = _BY_NAME[requested]
        reason = backend.unavailable_reason(spec)
        if reason is not None:
            raise BackendUnavailable(f"backend={requested!r} cannot run: {reason}")
        return backend
    skipped = []
    for backend in REGISTRY:
        reason = backend.unavailable_reason(spec)
        if reason is None:
            if skipped and spec.device.type == "cuda":
                _log_once(f"megatron-mok: auto uses the {backend.name} backend, not "
                          + "; not ".join(f"{name} ({why})" for name, why in skipped))
            return backend
        skipped.append((backend.name, reason))
    raise BackendUnavailable("no MoK backend can run this call: "
                             + "; ".join(f"{name}: {why}" for name, why in skipped))


@functools.lru_cache(maxsize=64)
def _log_once(message: str) -> None:
    log.warning(message)
