"""``register()``: install the ``mok`` dispatcher into Megatron-Core 0.19.

Megatron-Core has no dispatcher registry, so registration patches the three places that decide:

1. ``TransformerConfig.moe_token_dispatcher_type`` is typed ``Literal['allgather', 'alltoall',
   'flex']`` and Megatron's argument parser derives the flag's choices from that type: the type
   gains ``'mok'``, so ``--moe-token-dispatcher-type mok`` parses;
2. ``megatron.training.arguments.add_megatron_arguments`` gains the ``--mok-*`` flags
   (:mod:`.arguments`), and ``validate_args`` checks their values and, with ``mok``, the model
   settings MoK does not support (:mod:`.validation`; before Megatron's own checks, so MoK's
   advice comes first), the backend the MoE layers will run (:mod:`.backend_choice`) and the EP
   groups' NVLink domain (:mod:`.peers`), before anything is built (:mod:`.startup`);
3. ``MoELayer.__new__`` returns a :class:`~.layer.MoKMoELayer` when the config's dispatcher type
   is ``'mok'``. Every spec function (``get_gpt_layer_local_submodules``,
   ``get_gpt_layer_with_transformer_engine_spec``, ``get_gpt_decoder_block_spec``, the MTP
   block spec, hybrid/Mamba specs, user specs) builds its MoE layers by calling ``MoELayer``, so
   all of them, decoder and MTP layers alike, get the MoK layer without being changed.

Nothing changes for other dispatcher types. Calling :func:`register` again does nothing.
"""

from __future__ import annotations

import typing
from typing import Literal

from .layer import MOK_DISPATCHER_TYPE

__all__ = ["register", "is_registered"]

_MARK = "_megatron_mok_registered"


def _extend_dispatcher_literal() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    if MOK_DISPATCHER_TYPE in choices:
        return
    extended = Literal[tuple(choices) + (MOK_DISPATCHER_TYPE,)]  # type: ignore[valid-type]
    field.type = extended
    TransformerConfig.__annotations__["moe_token_dispatcher_type"] = extended


def _patch_moe_layer_new() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if getattr(MoELayer, _MARK, False):
        return

    def __new__(cls, *args, **kwargs):
        if cls is MoELayer:
            config = kwargs.get("config", args[0] if args else None)
            if getattr(config, "moe_token_dispatcher_type", None) == MOK_DISPATCHER_TYPE:
                from .layer import MoKMoELayer

                cls = MoKMoELayer
        return object.__new__(cls)

    MoELayer.__new__ = __new__
    setattr(MoELayer, _MARK, True)


def _patch_argument_parser() -> None:
    try:
        from megatron.training import arguments as megatron_arguments
    except ImportError:  # megatron.training is not needed to build models with megatron-core
        return
    if getattr(megatron_arguments, _MARK, False):
        return
    from .arguments import add_mok_arguments, settings_from_args
    from .startup import check_args_before_megatron, check_job_after_megatron

    original_add = megatron_arguments.add_megatron_arguments
    original_validate = megatron_arguments.validate_args

    def add_megatron_arguments(parser):
        return add_mok_arguments(original_add(parser))

    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's own signature
        settings = settings_from_args(args)  # raises MoKConfigError for a bad --mok-* value
        uses_mok = (getattr(args, "moe_token_dispatcher_type", None) == MOK_DISPATCHER_TYPE
                    and bool(getattr(args, "num_experts", None)))
        if uses_mok:
            # MoK's own checks first: for a setting MoK refuses, the user reads MoK's reason and
            # advice, not the assertion Megatron's checks raise for a non-alltoall dispatcher.
            check_args_before_megatron(args, settings)
        result = original_validate(args, defaults)
        if uses_mok:
            # The checks the layer runs at construction, here at start-up, before any process
            # group or model exists: unsupported settings, the backend, the EP group's NVLink domain.
            check_job_after_megatron(args, megatron_arguments.core_transformer_config_from_args(args), settings)
        return result

    add_megatron_arguments.__doc__ = original_add.__doc__
    validate_args.__doc__ = original_validate.__doc__
    megatron_arguments.add_megatron_arguments = add_megatron_arguments
    megatron_arguments.validate_args = validate_args
    setattr(megatron_arguments, _MARK, True)


def register() -> None:
    """Make ``mok`` a Megatron-Core MoE token dispatcher (idempotent).

    After this call ``--moe-token-dispatcher-type mok`` and the ``--mok-*`` flags parse in
    Megatron's argument parser, and every ``MoELayer`` built from a config whose
    ``moe_token_dispatcher_type`` is ``"mok"`` is a :class:`~.layer.MoKMoELayer`. A user's own
    copy of Megatron-LM's ``pretrain_gpt.py`` needs only ``import megatron_mok;
    megatron_mok.register()`` before it parses its arguments.
    """
    _extend_dispatcher_literal()
    _patch_moe_layer_new()
    _patch_argument_parser()


def is_registered() -> bool:
    """Whether :func:`register` has run in this process."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return bool(getattr(MoELayer, _MARK, False))
