"""What a Megatron user meets at start-up with ``--moe-token-dispatcher-type mok`` (CPU only):

* no silent slow path: ``--mok-backend auto`` where no GPU backend can run the MoE layers (fp16,
  fp32, a GPU that is not sm_90, a shape the GPU backends refuse) fails with one message saying
  why and what to do; ``--mok-backend reference`` runs the slow path on purpose; the layers
  print which backend they run, visible at any logging level;
* MoK's checks run before Megatron's own: every setting MoK refuses or replaces, given on the
  command line, gets MoK's message (not Megatron's assertion);
* the EP group's NVLink domain comes from NVML's fabric information (faked here: a stand-in
  libnvidia-ml built with gcc, and GPU places given directly), decided at argument validation
  through torchrun's key-value store;
* rank 0 says how much memory the training ring reserves (``--mok-training-ring-rows``), and a
  bad value stops the launcher with MoKConfig's message.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.config import default_training_ring_rows, training_ring_bytes
from megatron_mok.megatron import MoKLayerSettings
from megatron_mok.megatron.arg_files import expand_arg_files
from megatron_mok.megatron.backend_choice import MoKBackendError, choose_backend
from megatron_mok.megatron.peers import (EPTopologyError, GpuPlace, check_ep_domains_at_startup, ep_domain_problem,
                                         nvml_fabric)
from megatron_mok.megatron.startup import (format_bytes, moe_layer_count, tokens_per_rank, training_ring_line,
                                           training_ring_of)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [f"@{ROOT}/configs/tiny.args", f"@{ROOT}/configs/local_no_te.args", "--micro-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-4", "--moe-token-dispatcher-type", "mok"]


def _layer_config(**changes):
    """The MoE fields of a layer config (what choose_backend reads)."""
    fields = dict(hidden_size=256, ffn_hidden_size=512, moe_ffn_hidden_size=256, num_moe_experts=8,
                  moe_router_topk=2, expert_model_parallel_size=1, moe_shared_expert_intermediate_size=None,
                  bf16=True, fp16=False, params_dtype=torch.bfloat16)
    fields.update(changes)
    return SimpleNamespace(**fields)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device 0 of the given capability on this CPU machine (the answers the backends read
    about it), the library's device cache cleared before and after."""
    from megatron_mok.functional import backend as functional_backend

    def install(capability, name="NVIDIA H200"):
        functional_backend._device_unavailable_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        return torch.device("cuda", 0)

    yield install
    functional_backend._device_unavailable_reason.cache_clear()


# ----------------------------------------------------------------------------------------------
# 1. No silent slow path.


@pytest.mark.parametrize("dtype_fields,setting", [
    (dict(bf16=False, fp16=True, params_dtype=torch.float16), "fp16=True (--fp16)"),
    (dict(bf16=False, params_dtype=torch.float32), "params_dtype=torch.float32 (neither --bf16 nor --fp16)"),
])
def test_auto_refuses_a_dtype_the_gpu_backends_do_not_take(dtype_fields, setting):
    config = _layer_config(**dtype_fields)
    with pytest.raises(MoKBackendError) as err:
        choose_backend(config, MoKLayerSettings(), device=None)  # argument validation, no GPU here
    message = str(err.value)
    assert message.startswith("--moe-token-dispatcher-type mok with --mok-backend auto: no MoK GPU backend")
    assert f"  - {setting}: MoK's GPU backends (megakernel, cuda) compute in bf16" in message
    assert "train with --bf16, or pass --mok-backend reference" in message
    # Asked for, the reference backend runs (and says why it is slow).
    choice = choose_backend(config, MoKLayerSettings(backend="reference"), device=None)
    assert choice.backend == "reference" and "correctness oracle" in choice.why
    # A layer on the CPU (tests, the CPU demo) runs the reference: the only backend there.
    assert choose_backend(config, MoKLayerSettings(), device=torch.device("cpu")).backend == "reference"


def test_auto_refuses_a_gpu_that_is_not_sm90(fake_gpu):
    device = fake_gpu((10, 0), "NVIDIA B200")
    with pytest.raises(MoKBackendError) as err:
        choose_backend(_layer_config(), MoKLayerSettings(), device=device)
    message = str(err.value)
    assert "device=NVIDIA B200 (sm_100, GPU 0): MoK's GPU kernels are built for sm_90a (H100/H200) only" in message
    assert "use Megatron's --moe-token-dispatcher-type alltoall (or flex) on these GPUs" in message
    # fp16 on that GPU: both reasons in one message.
    with pytest.raises(MoKBackendError) as err:
        choose_backend(_layer_config(bf16=False, fp16=True), MoKLayerSettings(), device=device)
    assert "fp16=True" in str(err.value) and "sm_100" in str(err.value)
    # An explicitly requested GPU backend names the same reason.
    with pytest.raises(Exception, match=r"mok_backend='cuda': the MoK kernels are built for sm_90a"):
        choose_backend(_layer_config(), MoKLayerSettings(backend="cuda"), device=device)


def _library_or_skip():
    from megatron_mok.ops.library import LibraryUnavailable, load_library

    try:
        load_library()
    except LibraryUnavailable as err:
        pytest.skip(f"the MoK library is not built here ({err})")


def test_auto_on_sm90_takes_a_gpu_backend_or_names_the_shape(fake_gpu):
    _library_or_skip()
    device = fake_gpu((9, 0))
    # Hidden 136: a multiple of 8 (the cuda backend takes it), not of the megakernel's tile.
    choice = choose_backend(_layer_config(hidden_size=136), MoKLayerSettings(), device=device)
    assert choice.backend == "cuda" and "not megakernel (hidden size 136 is not a multiple of" in choice.why
    with pytest.raises(MoKBackendError) as err:
        choose_backend(_layer_config(hidden_size=100), MoKLayerSettings(), device=device)
    message = str(err.value)
    assert "MoE layer shape (hidden_size=100, moe_ffn_hidden_size=256, 8 experts per rank, top-2" in message
    assert "cuda: hidden size 100 is not a multiple of 8" in message and "change the size a reason names" in message


def test_the_launcher_stops_fp16_with_one_message():
    cmd = [sys.executable, "-m", "megatron_mok.pretrain_gpt", "@configs/tiny.args", "@configs/local_no_te.args",
           "--moe-token-dispatcher-type", "mok", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
           "--fp16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mok-pretrain-gpt: error: --moe-token-dispatcher-type mok with --mok-backend auto: no MoK GPU backend" \
        in proc.stderr
    assert "fp16=True (--fp16): MoK's GPU backends (megakernel, cuda) compute in bf16" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# 2. MoK's checks before Megatron's, from the command line.

FLAGS = [
    (["--moe-shared-expert-overlap"], "moe_shared_expert_overlap=True", "use --mok-fuse-shared-expert"),
    (["--overlap-moe-expert-parallel-comm"], "overlap_moe_expert_parallel_comm=True",
     "remove --overlap-moe-expert-parallel-comm"),
    (["--moe-enable-deepep"], "moe_enable_deepep=True", "remove --moe-enable-deepep"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], "recompute_modules=['moe_act']",
     "use --recompute-modules moe"),
    (["--delay-wgrad-compute"], "delay_wgrad_compute=True", "cannot be deferred"),
    (["--overlap-dispatch-backward-with-experts-wgrad"], "overlap_dispatch_backward_with_experts_wgrad=True",
     "cannot be deferred"),
    (["--ep-overlap-early-attn-memory-release"], "ep_overlap_early_attn_memory_release=True",
     "remove --ep-overlap-early-attn-memory-release"),
    (["--moe-pad-expert-input-to-capacity"], "moe_pad_expert_input_to_capacity=True", "never drops or pads"),
    (["--moe-expert-capacity-factor", "1.5"], "moe_expert_capacity_factor=1.5", "never drops tokens"),
    (["--tensor-model-parallel-size", "2"], "expert_tensor_parallel_size=2", "--expert-tensor-parallel-size 1"),
    (["--cuda-graph-impl", "local"], "cuda_graph_modules='whole layer'", "--cuda-graph-modules attn"),
    (["--moe-router-padding-for-quantization"], "moe_router_padding_for_quantization=True", "needs no router padding"),
]


@pytest.mark.parametrize("flags,setting,advice", FLAGS, ids=[f[1].split("=")[0] for f in FLAGS])
def test_mok_refuses_a_flag_before_megatron_validates_it(flags, setting, advice, monkeypatch):
    """Each of these also fails Megatron's own validation (validate_args or
    TransformerConfig.__post_init__) for a dispatcher that is not alltoall/flex; the user must
    read MoK's reason and advice instead."""
    import megatron_mok
    from megatron_mok.megatron import MoKUnsupportedError

    megatron_mok.register()  # before the import: it replaces validate_args
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + expand_arg_files(TINY) + ["--bf16"] + flags)
    args = parse_args()
    with pytest.raises(MoKUnsupportedError) as err, contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    message = str(err.value)
    assert message.startswith("--moe-token-dispatcher-type mok does not support these settings:")
    problems = [line[4:] for line in message.splitlines()[1:]]
    assert len(problems) == 1, problems
    assert problems[0].startswith(setting) and advice in problems[0]


def test_the_launcher_reports_mok_advice_for_the_shared_expert_overlap():
    cmd = [sys.executable, "-m", "megatron_mok.pretrain_gpt", "@configs/tiny.args", "@configs/local_no_te.args",
           "--moe-token-dispatcher-type", "mok", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
           "--bf16", "--moe-shared-expert-overlap", "--logging-level", "40"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("mok-pretrain-gpt: error: --moe-token-dispatcher-type mok does not support these settings:\n"
            "  - moe_shared_expert_overlap=True: overlapping the shared expert") in proc.stderr
    assert "Traceback" not in proc.stderr and "only works with alltoall or flex" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# 3. The NVLink domain, from NVML's fabric information.

FAKE_NVML = r"""
#include <string.h>
#include <stdlib.h>
typedef struct { unsigned char clusterUuid[16]; int status; unsigned int cliqueId; unsigned char state; } info_t;
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetHandleByUUID(const char *uuid, void **handle) {
    if (strncmp(uuid, "GPU-", 4)) return 2;
    *handle = (void *)(long)atoi(uuid + 4);   /* "GPU-<case>" */
    return 0;
}
int nvmlDeviceGetGpuFabricInfo(void *handle, info_t *info) {
    long which = (long)handle;
    memset(info, 0, sizeof *info);
    if (which == 3) return 3;                   /* NVML_ERROR_NOT_SUPPORTED: an HGX H200 */
    if (which == 2) { info->state = 2; return 0; }  /* registration in progress */
    info->state = 3;                              /* completed */
    if (which == 4) return 0;                     /* completed, no cluster UUID */
    for (int i = 0; i < 16; i++) info->clusterUuid[i] = (unsigned char)(0xa0 + i);
    info->cliqueId = which == 1 ? 7 : 8;
    return 0;
}
"""


def test_nvml_fabric_information_through_ctypes(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    source = tmp_path / "fake_nvml.c"
    source.write_text(FAKE_NVML)
    library = tmp_path / "libnvidia-ml.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    uuid = bytes(range(0xa0, 0xb0)).hex()
    assert nvml_fabric("GPU-1", library=str(library)) == (uuid, 7, "completed")
    assert nvml_fabric("GPU-5", library=str(library)) == (uuid, 8, "completed")
    assert nvml_fabric("GPU-2", library=str(library)) == (None, None, "in progress")
    assert nvml_fabric("GPU-3", library=str(library)) == (None, None, "not supported")
    assert nvml_fabric("GPU-4", library=str(library)) == (None, None, "completed without a cluster UUID")
    assert nvml_fabric("GPU-1", library=str(tmp_path / "missing.so"))[2].startswith("NVML unavailable")


def _place(host, device=0, clique=None, cluster="c1" * 16):
    if clique is None:
        return GpuPlace(host=host, device=device, fabric="not supported")
    return GpuPlace(host=host, device=device, cluster_uuid=cluster, clique_id=clique, fabric="completed")


def test_ep_domain_from_fabric_cluster_and_clique():
    one_host = [(r, _place("node-a", r)) for r in range(4)]
    assert ep_domain_problem(one_host) is None  # one host is one domain, fabric or not
    rack = [(r, _place(f"tray-{r // 4}", r % 4, clique=3)) for r in range(8)]
    assert ep_domain_problem(rack) is None
    # Two racks that both expose a fabric (the old IMEX-channel heuristic passed them).
    two_racks = rack[:4] + [(r, _place(f"tray-{r // 4}", r % 4, clique=4)) for r in range(4, 8)]
    message = ep_domain_problem(two_racks, ep_size=8)
    assert message.startswith("expert_model_parallel_size=8: the EP group of ranks 0-7 spans hosts tray-0, tray-1")
    assert "Outside the domain of rank 0 (host tray-0, NVLink cluster c1c1c1c1..., clique 3): ranks 4-7 on host " \
           "tray-1 (NVLink cluster c1c1c1c1..., clique 4)" in message
    assert "lower --expert-model-parallel-size" in message and "alltoall or flex across domains" in message
    # Plain nodes (no multi-node fabric).
    plain = [(r, _place(f"node-{r // 2}", r % 2)) for r in range(6)]
    message = ep_domain_problem(plain)
    assert "ranks 2-3 on host node-1 (no multi-node NVLink fabric: NVML fabric state 'not supported'); " \
           "ranks 4-5 on host node-2" in message


def _args(rank, world, ep, tp=1, pp=1):
    return SimpleNamespace(rank=rank, world_size=world, expert_model_parallel_size=ep, tensor_model_parallel_size=tp,
                           expert_tensor_parallel_size=1, pipeline_model_parallel_size=pp)


def test_domains_are_checked_at_argument_validation_through_the_store():
    """Four ranks (threads) exchange their GPUs' places through a TCPStore, as torchrun's ranks
    do at validate_args, and each checks its EP group (Megatron's rank layout)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def run(places, ep, prefix):
        results = {}

        def rank(r):
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
            try:
                results[r] = check_ep_domains_at_startup(_args(r, len(places), ep),
                                                         store=dist.PrefixStore(prefix, client), place=places[r])
            except EPTopologyError as err:
                results[r] = err

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(places))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return results

    # EP 2 on two hosts of one rack: fine; EP groups are (0, 1) and (2, 3).
    rack = [_place("tray-0", 0, 5), _place("tray-0", 1, 5), _place("tray-1", 0, 5), _place("tray-1", 1, 5)]
    assert run(rack, 4, "a/") == {r: True for r in range(4)}
    # EP 4 across two plain nodes: every rank fails with the same message.
    plain = [_place("node-a", 0), _place("node-a", 1), _place("node-b", 0), _place("node-b", 1)]
    results = run(plain, 4, "b/")
    assert all(isinstance(e, EPTopologyError) for e in results.values()), results
    assert "ranks 2-3 on host node-b (no multi-node NVLink fabric" in str(results[0])
    # EP 2: the groups are (0, 1) on node-a and (2, 3) on node-b, each one host.
    assert run(plain, 2, "c/") == {r: True for r in range(4)}


def test_without_torchrun_the_check_waits_for_the_layer(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert check_ep_domains_at_startup(_args(0, 4, 4)) is False  # checked when the first MoK layer is built
    assert check_ep_domains_at_startup(_args(0, 4, 1)) is True  # EP 1: nothing to check


# ----------------------------------------------------------------------------------------------
# 4. The training ring's memory, said at start-up.

ROW_BYTES_DSV3 = 2 * 7168 + 4 + 4 * 2048  # x bf16, router weight fp32, gate|up bf16


def _ring_args(**changes):
    fields = dict(seq_length=4096, micro_batch_size=1, tensor_model_parallel_size=1, sequence_parallel=False,
                  context_parallel_size=1, rank=0)
    fields.update(changes)
    return SimpleNamespace(**fields)


def _dsv3_config(**changes):
    """DeepSeek-V3's MoE layer shape at EP 64 (4 experts per rank): 3 dense + 58 MoE layers + MTP."""
    fields = dict(hidden_size=7168, ffn_hidden_size=18432, moe_ffn_hidden_size=2048, num_moe_experts=256,
                  moe_router_topk=8, expert_model_parallel_size=64, moe_shared_expert_intermediate_size=2048,
                  num_layers=61, moe_layer_freq=[0] * 3 + [1] * 58, mtp_num_layers=1)
    fields.update(changes)
    return SimpleNamespace(**fields)


def test_tokens_per_rank_and_moe_layer_count():
    assert tokens_per_rank(_ring_args()) == 4096
    assert tokens_per_rank(_ring_args(micro_batch_size=2, tensor_model_parallel_size=4)) == 8192  # TP without SP
    assert tokens_per_rank(_ring_args(micro_batch_size=2, tensor_model_parallel_size=4, sequence_parallel=True)) == 2048
    assert tokens_per_rank(_ring_args(context_parallel_size=2, tensor_model_parallel_size=2,
                                      sequence_parallel=True)) == 1024
    assert moe_layer_count(_dsv3_config()) == 59  # the MTP layer is built from the last (MoE) layer's spec
    assert moe_layer_count(_dsv3_config(mtp_num_layers=None)) == 58
    # Layers 0, 2, 4 and 6 are MoE layers; the last is dense, so the MTP layer is too.
    assert moe_layer_count(_dsv3_config(num_layers=8, moe_layer_freq=2, mtp_num_layers=1)) == 4
    assert moe_layer_count(_dsv3_config(num_layers=8, moe_layer_freq=1)) == 9
    assert moe_layer_count(_dsv3_config(num_moe_experts=None)) == 0


def test_training_ring_rows_and_bytes_of_the_default_and_of_the_flag():
    ring = training_ring_of(_ring_args(), _dsv3_config(), MoKLayerSettings())
    rows = default_training_ring_rows(tokens=4096, topk=8, experts_per_rank=4, tile_rows=128)
    assert rows >= 4096 * 8 and rows % 128 == 0
    assert (ring.rows, ring.tokens, ring.topk, ring.experts_per_rank, ring.moe_layers) == (rows, 4096, 8, 4, 59)
    assert ring.bytes_per_layer == rows * ROW_BYTES_DSV3 and ring.total_bytes == 59 * ring.bytes_per_layer
    assert training_ring_line(ring) == (
        f"> megatron-mok: MoK training ring: {rows} rows per MoE layer and micro-batch "
        f"({format_bytes(rows * ROW_BYTES_DSV3)}; 59 MoE layers: {format_bytes(59 * rows * ROW_BYTES_DSV3)} held "
        "until their backward) [the default for 4096 tokens per rank, top-8, 4 experts per rank; "
        "--mok-training-ring-rows sets it]")
    # The fused shared expert is one more slot per token and one more local expert.
    fused = training_ring_of(_ring_args(), _dsv3_config(), MoKLayerSettings(fuse_shared_expert=True))
    assert (fused.topk, fused.experts_per_rank) == (9, 5)
    assert fused.rows == default_training_ring_rows(tokens=4096, topk=9, experts_per_rank=5, tile_rows=128)
    # Sequence parallelism over TP 2 halves the tokens of a rank.
    sp = training_ring_of(_ring_args(tensor_model_parallel_size=2, sequence_parallel=True), _dsv3_config(),
                          MoKLayerSettings())
    assert sp.rows == default_training_ring_rows(tokens=2048, topk=8, experts_per_rank=4, tile_rows=128)
    given = training_ring_of(_ring_args(), _dsv3_config(), MoKLayerSettings(config=MoKConfig(training_ring_rows=8192)))
    assert given.rows == 8192 and given.configured and given.bytes_per_layer == 8192 * ROW_BYTES_DSV3
    assert training_ring_line(given).endswith("(176 MiB; 59 MoE layers: 10.1 GiB held until their backward) "
                                              "[--mok-training-ring-rows 8192]")
    none = training_ring_of(_ring_args(), _dsv3_config(), MoKLayerSettings(config=MoKConfig(training_ring_rows=0)))
    assert "0 rows per MoE layer and micro-batch (0.00 MiB; 59 MoE layers: 0.00 MiB held until their backward; " \
           "every row is replayed in the backward)" in training_ring_line(none)
    assert [format_bytes(n) for n in (0, 2 ** 20, 1536 * 2 ** 20, 70 * 2 ** 30, 123 * 2 ** 20)] == \
        ["0.00 MiB", "1.00 MiB", "1.50 GiB", "70.0 GiB", "123 MiB"]


def test_validate_args_prints_the_training_ring_on_rank_0(monkeypatch, capsys):
    import megatron_mok

    megatron_mok.register()  # before the import: it replaces validate_args
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + expand_arg_files(TINY) + ["--bf16"])
    validate_args(parse_args(), {})
    lines = [line for line in capsys.readouterr().out.splitlines() if "MoK training ring" in line]
    # configs/tiny.args: 128 tokens, top-2, 8 experts, H 128, I 128 (2 x 128 + 4 + 4 x 128 = 772 bytes a
    # row); decoder layer 2 and the MTP layer.
    rows = default_training_ring_rows(tokens=128, topk=2, experts_per_rank=8, tile_rows=128)
    assert lines == [f"> megatron-mok: MoK training ring: {rows} rows per MoE layer and micro-batch "
                     f"({format_bytes(rows * 772)}; 2 MoE layers: {format_bytes(2 * rows * 772)} held until their "
                     "backward) [the default for 128 tokens per rank, top-2, 8 experts per rank; "
                     "--mok-training-ring-rows sets it]"]


def test_the_launcher_stops_a_bad_training_ring_with_mokconfig_message():
    cmd = [sys.executable, "-m", "megatron_mok.pretrain_gpt", "@configs/tiny.args", "@configs/local_no_te.args",
           "--moe-token-dispatcher-type", "mok", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
           "--bf16", "--mok-training-ring-rows", "1000"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("mok-pretrain-gpt: error: MoKConfig.training_ring_rows=1000 must be a multiple of tile_rows=128"
            in proc.stderr)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("backend, tile", [("megakernel", 128), ("cuda", 128), ("cuda", 64)])
def test_a_shape_outside_the_hopper_gemms_says_it_keeps_every_row(backend, tile):
    """A GPU backend on a shape whose backward cannot replay (I not a multiple of 256) keeps the
    worst-case layout, P T K + L (tile - 1) rows, and the start-up line says so and why."""
    settings = MoKLayerSettings(config=MoKConfig(tile_rows=tile))
    ring = training_ring_of(_ring_args(), _dsv3_config(moe_ffn_hidden_size=1408), settings, backend=backend)
    rows = 64 * 4096 * 8 + 4 * (tile - 1)
    assert ring.keeps_every_row is not None and ring.rows == rows
    assert ring.bytes_per_layer == training_ring_bytes(rows, 7168, 1408)
    line = training_ring_line(ring)
    assert line.startswith(f"> megatron-mok: MoK keeps every routed row's activations for the backward: {rows} rows "
                           "per MoE layer and micro-batch, the worst case (")
    assert "expert FFN 1408" in line and "outside MoK's Hopper GEMMs" in line
    # The reference backend keeps what autograd keeps; a shape the GEMMs take gets the ring.
    assert training_ring_of(_ring_args(), _dsv3_config(moe_ffn_hidden_size=1408), settings,
                            backend="reference").keeps_every_row is None
    assert training_ring_of(_ring_args(), _dsv3_config(), settings, backend=backend).keeps_every_row is None
