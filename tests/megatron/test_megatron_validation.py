"""Clear start-up errors for what the MoK layer does not support: each names the setting, its
value, why MoK cannot honour it and what to do."""

import copy
import os
import subprocess
import sys

import pytest
import torch.nn.functional as F

from megatron_mok.megatron import MoKLayerSettings, MoKUnsupportedError, check_supported, unsupported_settings
from megatron_mok.megatron.peers import GpuPlace, peer_access_problem
from tests.megatron.megatron_utils import moe_spec_layer, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**changes):
    """The tiny MoK config with attributes changed after construction (Megatron's own
    ``__post_init__`` refuses some of these combinations for a non-alltoall dispatcher, or
    needs Transformer Engine for them; the MoK check must catch them either way)."""
    config = copy.copy(tiny_config("mok", 1))
    for name, value in changes.items():
        setattr(config, name, value)
    return config


CASES = [
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2", "--expert-tensor-parallel-size 1"),
    (dict(moe_expert_capacity_factor=1.25), "moe_expert_capacity_factor=1.25", "never drops tokens"),
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity=True", "never drops or pads"),
    (dict(gated_linear_unit=False), "gated_linear_unit=False", "use --swiglu"),
    (dict(activation_func=F.gelu), "activation_func=gelu", "SwiGLU"),
    (dict(add_bias_linear=True), "add_bias_linear=True", "--disable-bias-linear"),
    (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input=True", "after SwiGLU"),
    (dict(fp8="e4m3"), "fp8='e4m3'", "remove --fp8"),
    (dict(moe_latent_size=16), "moe_latent_size=16", "latent MoE"),
    (dict(moe_shared_expert_overlap=True), "moe_shared_expert_overlap=True", "--mok-fuse-shared-expert"),
    (dict(overlap_moe_expert_parallel_comm=True), "overlap_moe_expert_parallel_comm=True", "inside one kernel"),
    (dict(delay_wgrad_compute=True), "delay_wgrad_compute=True", "cannot be deferred"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=[]), "cuda_graph_modules='whole layer'", "--cuda-graph-modules attn"),
    (dict(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size=32", "all gate rows then all up rows"),
]


@pytest.mark.parametrize("changes,setting,advice", CASES, ids=[c[1].split("=")[0] for c in CASES])
def test_unsupported_setting_is_named_with_reason(changes, setting, advice):
    problems = unsupported_settings(_config(**changes), MoKLayerSettings())
    assert len(problems) == 1, problems
    assert problems[0].startswith(setting) and advice in problems[0]


def test_supported_config_passes_and_errors_are_listed_together():
    assert unsupported_settings(tiny_config("mok", 1), MoKLayerSettings()) == []
    with pytest.raises(MoKUnsupportedError) as err:
        check_supported(_config(expert_tensor_parallel_size=4, moe_expert_capacity_factor=1.0), MoKLayerSettings())
    message = str(err.value)
    assert message.startswith("--moe-token-dispatcher-type mok does not support these settings:")
    assert "expert_tensor_parallel_size=4" in message and "moe_expert_capacity_factor=1.0" in message


def test_fused_shared_expert_requirements():
    fused = MoKLayerSettings(fuse_shared_expert=True)
    assert unsupported_settings(tiny_config("mok", 1), fused) == []
    problems = unsupported_settings(_config(tensor_model_parallel_size=2, moe_shared_expert_intermediate_size=24), fused)
    assert any(p.startswith("tensor_model_parallel_size=2") and "weights whole" in p for p in problems)
    assert any(p.startswith("moe_shared_expert_intermediate_size=24") and "multiple of" in p for p in problems)
    # Without fusion the same shapes are fine: Megatron's module computes the shared expert.
    assert unsupported_settings(_config(moe_shared_expert_intermediate_size=24), MoKLayerSettings()) == []


def test_layer_construction_fails_before_building_anything():
    import megatron_mok

    megatron_mok.register()
    with pytest.raises(MoKUnsupportedError, match="moe_expert_capacity_factor=2.0"):
        moe_spec_layer(_config(moe_expert_capacity_factor=2.0))


def test_ep_ranks_on_one_host_without_peer_access_are_refused(monkeypatch):
    import socket

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    here = socket.gethostname()
    members = [(0, GpuPlace(host=here, device=0)), (1, GpuPlace(host=here, device=1))]
    message = peer_access_problem(members, can_access=lambda a, b: False)
    assert f"ranks 0 and 1 on host {here} use GPUs 0 and 1, which have no peer access" in message
    assert peer_access_problem(members, can_access=lambda a, b: True) is None


def test_launcher_reports_unsupported_settings_at_startup():
    cmd = [sys.executable, "-m", "megatron_mok.pretrain_gpt", "@configs/tiny.args", "@configs/local_no_te.args",
           "--moe-token-dispatcher-type", "mok", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
           "--moe-expert-capacity-factor", "1.0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mok-pretrain-gpt: error: --moe-token-dispatcher-type mok does not support" in proc.stderr
    assert "moe_expert_capacity_factor=1.0: MoK never drops tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_megatron_bridge_recipe_settings():
    """Megatron-Bridge's providers and recipes (0.6.2) set these for alltoall/flex; docs/megatron.md
    says which to turn off for mok. Here the MoE settings of its DeepSeek-V3 / Kimi-K2 provider and
    of its Qwen3-30B-A3B 16-GPU recipe are copied onto the tiny config: MoK refuses exactly the ones
    the docs name, and the config passes once they are changed as the docs say."""
    deepseek_provider = dict(moe_grouped_gemm=True, moe_shared_expert_overlap=True, moe_router_pre_softmax=True,
                             moe_permute_fusion=True, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_dtype="fp32")
    qwen3_30b_recipe = dict(moe_grouped_gemm=True, moe_token_dispatcher_type="mok", moe_flex_dispatcher_backend="hybridep",
                            moe_shared_expert_overlap=False, cuda_graph_impl="transformer_engine",
                            cuda_graph_scope=["moe_router", "moe_preprocess"], moe_router_fusion=True)
    problems = unsupported_settings(_config(**deepseek_provider), MoKLayerSettings())
    assert [p.split("=")[0] for p in problems] == ["moe_shared_expert_overlap"], problems
    problems = unsupported_settings(_config(**qwen3_30b_recipe), MoKLayerSettings())
    assert [p.split("=")[0] for p in problems] == ["cuda_graph_modules"], problems
    assert "moe_router" in problems[0] and "--cuda-graph-modules attn" in problems[0]
    # The documented changes.
    assert unsupported_settings(_config(**{**deepseek_provider, "moe_shared_expert_overlap": False}),
                                MoKLayerSettings()) == []
    assert unsupported_settings(_config(**deepseek_provider), MoKLayerSettings(fuse_shared_expert=True)) != []
    assert unsupported_settings(_config(**{**qwen3_30b_recipe, "cuda_graph_impl": "none"}), MoKLayerSettings()) == []
    assert unsupported_settings(_config(**{**qwen3_30b_recipe, "cuda_graph_scope": ["attn"]}), MoKLayerSettings()) == []
