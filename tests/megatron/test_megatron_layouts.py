"""Production parallel layouts on the CPU: tensor parallelism 2 with sequence parallelism and
expert-tensor parallelism 1, pipeline parallelism 2 with virtual stages.

* The launcher's CPU dry run builds them with ``mok`` (torchrun, 2 gloo ranks, meta device).
* Where the CPU allows, the MoK layer is compared with Megatron's ``alltoall`` layer in the same
  layout (2 gloo ranks, real tensors, reference backend): the MoE layer under TP 2 + SP + ETP 1
  (each rank holds its own sequence shard), and every model chunk of PP 2 x 2 virtual stages
  (same parameters; same output and gradients for the same input of the chunk).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.distributed import free_port
from tests.megatron.megatron_utils import BATCH, SEQ, VOCAB, assert_close_tensors, megatron_ranks, moe_spec_layer, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {
    "tp2-sp-etp1": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                     "--expert-model-parallel-size", "2"],
                    "TP 2 (SP), ETP 1, EP 2, PP 1", [(0, ", 2 MoE layers"), (1, ", 2 MoE layers")]),
    "pp2-virtual": (["--num-layers", "4", "--moe-layer-freq", "[0]+[1]*3", "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1"],
                    "TP 1, ETP 1, EP 1, PP 2 x 2 virtual",
                    # stage 0: layers 1 (dense) and 3; stage 1: layers 2 and 4, and the MTP layer
                    [(0, " in 2 virtual pipeline stages, 1 MoE layers"), (1, " in 2 virtual pipeline stages, 3 MoE layers")]),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of the launcher")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_launcher_dry_run_builds_the_layout_with_mok(name):
    flags, layout, ranks = LAYOUTS[name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "megatron_mok.pretrain_gpt", "@configs/tiny.args", "@configs/local_no_te.args",
           "--moe-token-dispatcher-type", "mok", "--bf16", "--micro-batch-size", "1", "--train-iters", "1",
           "--lr", "1e-4", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    for rank, layers in ranks:
        line = re.search(rf"meta device: rank {rank} \(pipeline stage \d; {re.escape(layout)}\): [0-9.]+M parameters "
                         rf"on this rank{re.escape(layers)} \(MoKMoELayer\)", out)
        assert line, f"rank {rank}: no description with {layout!r} and {layers!r}:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 1 and "mok-pretrain-gpt: error" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# TP 2 + SP + ETP 1: the MoE layer against alltoall.


def _tp2_sp_moe_layer(rank, world):
    import megatron_mok
    from megatron_mok.megatron import MoKLayerSettings, MoKMoELayer

    megatron_mok.register()
    layout = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    torch.manual_seed(5)
    ref = moe_spec_layer(tiny_config("alltoall", world, **layout))
    mok = moe_spec_layer(tiny_config("mok", world, mok_settings=MoKLayerSettings(backend="reference"), **layout))
    assert isinstance(mok, MoKMoELayer) and not isinstance(ref, MoKMoELayer)
    assert mok.num_local_experts == ref.num_local_experts == 4  # whole experts, 4 per rank (ETP 1)
    mok.load_state_dict(ref.state_dict(), strict=True)
    outputs, grads = {}, {}
    for name, layer in (("alltoall", ref), ("mok", mok)):
        layer.train()
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own sequence shard
        x = torch.randn(SEQ // 2, BATCH, 32, generator=gen).requires_grad_()
        y, _ = layer(x)
        y.backward(torch.ones_like(y))
        outputs[name] = {"y": y.detach(), "dx": x.grad}
        grads[name] = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    assert_close_tensors(outputs["alltoall"], outputs["mok"], "TP2 SP ETP1 output")
    assert_close_tensors(grads["alltoall"], grads["mok"], "TP2 SP ETP1 grad")


def test_tp2_sp_etp1_moe_layer_matches_alltoall():
    megatron_ranks(_tp2_sp_moe_layer, 2, tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1)


# ----------------------------------------------------------------------------------------------
# PP 2 x 2 virtual stages: every model chunk against alltoall.


def _chunks(config, seed):
    """This rank's model chunks (one per virtual stage), built as Megatron's model builder does."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage
    from megatron.core import parallel_state as ps

    torch.manual_seed(seed)
    chunks = []
    vp = config.virtual_pipeline_model_parallel_size
    for stage in range(vp):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=stage)
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            position_embedding_type="rope", vp_stage=stage,
            pre_process=is_vp_first_stage(stage, vp) and ps.is_pipeline_first_stage(ignore_virtual=True),
            post_process=is_vp_last_stage(stage, vp) and ps.is_pipeline_last_stage(ignore_virtual=True)))
    return chunks


def _pp2_virtual(rank, world):
    import megatron_mok
    from megatron_mok.megatron import MoKLayerSettings, MoKMoELayer
    from tests.megatron.megatron_utils import batch, moe_layers

    megatron_mok.register()
    layout = dict(num_layers=4, moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=None, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    ref_chunks = _chunks(tiny_config("alltoall", 1, **layout), seed=8)
    mok_chunks = _chunks(tiny_config("mok", 1, mok_settings=MoKLayerSettings(backend="reference"), **layout), seed=9)
    numbers = [[m.layer_number for _, m in moe_layers(c)] for c in mok_chunks]
    # Layer 1 is dense; rank 0 holds layers 1 and 3, rank 1 layers 2 and 4.
    assert numbers == ([[], [3]] if rank == 0 else [[2], [4]]), numbers
    tokens, position_ids, mask, labels = batch(rank)
    for stage, (ref, mok) in enumerate(zip(ref_chunks, mok_chunks)):
        assert all(isinstance(m, MoKMoELayer) for _, m in moe_layers(mok))
        assert {n: p.shape for n, p in ref.named_parameters()} == {n: p.shape for n, p in mok.named_parameters()}
        mok.load_state_dict(ref.state_dict(), strict=True)
        results = {}
        for name, chunk in (("alltoall", ref), ("mok", mok)):
            hidden = None
            if not chunk.pre_process:  # the previous chunk's output: the same input for both
                hidden = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(stage + 10 * rank))
                hidden.requires_grad_()
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, position_ids, mask, labels=labels if chunk.post_process else None)
            out.sum().backward()
            results[name] = {"out": out.detach(), **{n: p.grad.clone() for n, p in chunk.named_parameters()
                                                     if p.grad is not None}}
            if hidden is not None:
                results[name]["d_input"] = hidden.grad
        assert_close_tensors(results["alltoall"], results["mok"], f"rank {rank} virtual stage {stage}")


def test_pp2_virtual_stages_match_alltoall_chunk_by_chunk():
    megatron_ranks(_pp2_virtual, 2, expert_parallel=1, pipeline_parallel=2, virtual_pipeline_parallel=2)
