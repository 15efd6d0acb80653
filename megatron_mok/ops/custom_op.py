"""``mok_op``: a ``torch.library`` custom op that eager calls reach without the dispatcher.

The custom op is what ``torch.compile`` and fake tensors see (its registered fake gives the
output shapes). In eager mode the dispatcher's custom-op path (autograd and ADInplaceOrView
redispatch, version-counter bumps for every input of a ``mutates_args="unknown"`` op) cost
0.2-0.3 ms of host time per call on the GPU machine (tools/perf/host_profile.py, docs/perf-notes.md):
most of the megakernel backend's host time per layer, which a GPU waits for whenever nothing else
is queued ahead of the launch. Our ops are never differentiated through the dispatcher (the
backends wrap them in ``torch.autograd.Function``), so an eager call of plain tensors runs the
Python implementation directly.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Union

import torch


class MokOp:
    """Callable like the function it wraps: ``impl`` directly for plain tensors outside
    ``torch.compile``, the registered custom op ``op`` (``torch.ops.mok.<name>``) otherwise."""

    def __init__(self, op, impl: Callable):
        self.op = op
        self.impl = impl
        functools.update_wrapper(self, impl)

    def __call__(self, *args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if type(first) is torch.Tensor and not torch.compiler.is_compiling():
            return self.impl(*args, **kwargs)
        return self.op(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """Register the shape-only implementation on the custom op (decorator)."""
        return self.op.register_fake(fn)


def mok_op(name: str, mutates_args: Union[str, Iterable[str]]) -> Callable[[Callable], MokOp]:
    """Decorator: register ``fn`` as the custom op ``name`` (``torch.library.custom_op``) and
    return a :class:`MokOp` of it. The first argument of ``fn`` must be a tensor."""

    def wrap(fn: Callable) -> MokOp:
        return MokOp(torch.library.custom_op(name, mutates_args=mutates_args)(fn), fn)

    return wrap
