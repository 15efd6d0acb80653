"""``megatron_mok.register()``: the flag parses, the ``--mok-*`` tunables reach the layer, and
every way Megatron builds an MoE layer yields the MoK layer once the dispatcher type is ``mok``."""

import subprocess
import sys
import typing

import pytest
import torch

from tests.megatron.megatron_utils import build_gpt, megatron_ranks, moe_layers, moe_spec_layer, tiny_config

MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
               "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--swiglu", "--disable-bias-linear",
               "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
               "--train-iters", "1", "--lr", "1e-4"]


def _parse(monkeypatch, extra):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + MODEL_FLAGS + extra)
    return parse_args()


def test_register_is_idempotent_and_extends_the_dispatcher_choices():
    import megatron_mok
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_mok.register()
    megatron_mok.register()
    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    assert choices.count("mok") == 1 and {"allgather", "alltoall", "flex"} <= set(choices)
    from megatron_mok.megatron import is_registered

    assert is_registered()


def test_flag_and_tunables_parse(monkeypatch):
    import megatron_mok
    from megatron_mok import MegakernelTunables
    from megatron_mok.megatron import settings_from_args

    megatron_mok.register()
    args = _parse(monkeypatch, ["--moe-token-dispatcher-type", "mok", "--mok-backend", "reference",
                                "--mok-comm-sms", "6", "--mok-comm-sms-backward", "10",
                                "--mok-minibatch-rows", "256", "--mok-ring-rows", "1024",
                                "--mok-timeout-s", "5", "--mok-max-tokens-per-rank", "8192",
                                "--mok-fuse-shared-expert", "--mok-megakernel-pairs", "off",
                                "--mok-megakernel-group-blocks", "16", "--mok-training-ring-rows", "4096"])
    assert args.moe_token_dispatcher_type == "mok"
    settings = settings_from_args(args)
    assert settings.backend == "reference" and settings.fuse_shared_expert
    cfg = settings.config
    assert (cfg.comm_sms_forward, cfg.comm_sms_backward) == (6, 10)
    assert (cfg.minibatch_rows, cfg.ring_rows, cfg.timeout_s, cfg.max_tokens_per_rank) == (256, 1024, 5.0, 8192)
    assert cfg.megakernel == MegakernelTunables(pairs=False, group_blocks=16)
    assert cfg.training_ring_rows == 4096
    assert settings_from_args(_parse(monkeypatch, ["--mok-training-ring-rows", "0"])).config.training_ring_rows == 0
    small_tiles = settings_from_args(_parse(monkeypatch, ["--mok-training-ring-rows", "192", "--mok-tile-rows", "64"]))
    assert (small_tiles.config.training_ring_rows, small_tiles.config.tile_rows) == (192, 64)
    defaults = settings_from_args(_parse(monkeypatch, ["--moe-token-dispatcher-type", "mok"]))
    assert defaults.backend == "auto" and defaults.config.minibatch_rows is None
    assert defaults.config.training_ring_rows is None
    assert defaults.config.megakernel == MegakernelTunables()
    assert settings_from_args(_parse(monkeypatch, ["--mok-megakernel-pairs", "on"])).config.megakernel.pairs is True
    assert not defaults.fuse_shared_expert


def test_parser_still_rejects_unknown_dispatchers_and_backends(monkeypatch, capsys):
    import megatron_mok

    megatron_mok.register()
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["--moe-token-dispatcher-type", "moq"])
    assert "invalid choice: 'moq'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["--moe-token-dispatcher-type", "mok", "--mok-backend", "triton"])
    assert "invalid choice: 'triton'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--mok-minibatch-rows", "100"], r"minibatch_rows=100 must be a multiple of tile_rows=128"),
    (["--mok-megakernel-group-blocks", "3"], r"group_blocks=3 must be None \(the library's default\) or an even"),
    (["--mok-training-ring-rows", "100"], r"training_ring_rows=100 must be a multiple of tile_rows=128"),
    (["--mok-training-ring-rows", "-128"],
     r"training_ring_rows=-128 must be None \(chosen automatically\) or an integer >= 0"),
])
def test_validate_args_rejects_a_bad_tunable(monkeypatch, flags, message):
    import megatron_mok
    from megatron.training.arguments import validate_args

    from megatron_mok import MoKConfigError

    megatron_mok.register()
    args = _parse(monkeypatch, ["--moe-token-dispatcher-type", "mok"] + flags)
    with pytest.raises(MoKConfigError, match=message):
        validate_args(args, {})


def test_without_register_megatron_rejects_mok():
    code = ("import sys; from megatron.training.arguments import parse_args; "
            f"sys.argv = ['x'] + {MODEL_FLAGS!r} + ['--moe-token-dispatcher-type', 'mok']; parse_args()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "invalid choice: 'mok'" in proc.stderr


def _every_builder_gives_mok(rank, world):
    import megatron_mok
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mok.megatron import MoKLayerSettings, MoKMoELayer

    megatron_mok.register()
    config = tiny_config("mok", world)
    # Local layer spec (get_gpt_layer_local_submodules under the hood).
    assert type(moe_spec_layer(config)) is MoKMoELayer
    # MoELayer constructed directly from a TransformerConfig.
    submodules = get_gpt_layer_local_spec(num_experts=config.num_moe_experts).submodules.mlp.keywords["submodules"]
    direct = MoELayer(config=config, submodules=submodules)
    assert type(direct) is MoKMoELayer and isinstance(direct, MoELayer)
    # Decoder block spec and MTP block spec, inside a GPT model.
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    assert get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False) is not None
    layers = moe_layers(build_gpt(config))
    assert len(layers) == 2 and all(type(m) is MoKMoELayer for _, m in layers)
    # Other dispatcher types are untouched.
    assert type(moe_spec_layer(tiny_config("alltoall", world))) is MoELayer
    # --mok-* settings reach the layer; attached settings win over defaults.
    assert moe_spec_layer(config).mok_settings == MoKLayerSettings()
    config.mok_settings = MoKLayerSettings(backend="reference")
    assert moe_spec_layer(config).mok_settings.backend == "reference"


def test_megatron_specs_and_direct_construction_give_the_mok_layer():
    megatron_ranks(_every_builder_gives_mok, 1)


def _te_spec_gives_mok(rank, world):
    import megatron_mok
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_mok.megatron import MoKMoELayer

    megatron_mok.register()
    config = tiny_config("mok", world, moe_grouped_gemm=True)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=True)
    layer = spec.submodules.mlp(config=config, pg_collection=None, is_mtp_layer=False)
    assert type(layer) is MoKMoELayer
    assert type(layer.experts).__name__ == "TEGroupedMLP"


def test_transformer_engine_spec_gives_the_mok_layer():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE or not torch.cuda.is_available():
        pytest.skip("Transformer Engine (and a GPU for its layers) is not installed here; the TE spec "
                    "builds its MoE layer through the same MoELayer call as the local spec")
    megatron_ranks(_te_spec_gives_mok, 1)


def test_expert_weights_of_sequential_and_grouped_layouts():
    from types import SimpleNamespace

    from megatron_mok.megatron.experts import local_expert_weights, shared_expert_weights
    from megatron_mok.megatron.stacking import stacked

    w1 = [torch.full((4, 3), float(i)) for i in range(2)]
    w2 = [torch.full((3, 2), float(10 + i)) for i in range(2)]
    sequential = SimpleNamespace(local_experts=[
        SimpleNamespace(linear_fc1=SimpleNamespace(weight=a), linear_fc2=SimpleNamespace(weight=b))
        for a, b in zip(w1, w2)])
    grouped = SimpleNamespace(linear_fc1=SimpleNamespace(weight0=w1[0], weight1=w1[1]),
                              linear_fc2=SimpleNamespace(weight0=w2[0], weight1=w2[1]))
    for module in (sequential, grouped):
        fc1, fc2 = local_expert_weights(module, 2)
        assert stacked(fc1).shape == (2, 4, 3) and stacked(fc2).shape == (2, 3, 2)
        assert stacked(fc1)[1].eq(1).all() and stacked(fc2)[0].eq(10).all()
    with pytest.raises(TypeError, match="SequentialMLP .* or TEGroupedMLP"):
        local_expert_weights(SimpleNamespace(), 2)
    # Shared expert of size 2I = 4 with I = 2: gate rows 0-3, up rows 4-7, fc2 columns 0-3.
    shared = SimpleNamespace(linear_fc1=SimpleNamespace(weight=torch.arange(8.0)[:, None]),
                             linear_fc2=SimpleNamespace(weight=torch.arange(4.0)[None, :]))
    fc1, fc2 = shared_expert_weights(shared, 2)
    assert [t.reshape(-1).tolist() for t in fc1] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [t.reshape(-1).tolist() for t in fc2] == [[0, 1], [2, 3]]
