"""The forward megakernel (``megakernel`` backend, docs/megakernel.md) on the CPU: its C ABI (the
structs against the header, the library's defaults and constants as Python reports them, the
argument checks before any CUDA call), the op's Python checks and fake implementation, the
backend's shape rules and tunables, and its host path with the GPU steps recorded instead of
queued. The work plan and the protocol replay are in test_protocol.py, the GPU runs in
test_gpu.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import logging

import pytest
import torch

from megatron_mok import MoKConfig, MoKConfigError
from megatron_mok.config import MegakernelTunables
from megatron_mok.functional import BackendUnavailable, mok_moe
from megatron_mok.functional import backends, cuda_backend, megakernel_backend as mkb
from megatron_mok.functional.backend import CallSpec
from megatron_mok.functional.validate import MoEShape
from megatron_mok.ops import megakernel as mk

from tests.c_abi import struct_fields

KIMI = MoEShape(tokens=4096, hidden=7168, topk=8, experts_per_rank=192, ffn_hidden=2048)
MOK_ERR_INVALID_ARGUMENT = -1


# ---- the C ABI ------------------------------------------------------------------------------

def test_structs_match_the_header(use_lib):
    for header_name, struct in (("MokMegakernelArgs", mk.MegakernelArgs),
                                ("MokMegakernelTunables", mk.MegakernelTunablesStruct),
                                ("MokMegakernelConstants", mk.MegakernelConstantsStruct)):
        assert struct_fields("megakernel.h", header_name) == [f[0] for f in struct._fields_], header_name
    _, fns = mk._lib()
    assert fns["tunables_bytes"]() == ctypes.sizeof(mk.MegakernelTunablesStruct) == 8 * 5
    assert fns["constants_bytes"]() == ctypes.sizeof(mk.MegakernelConstantsStruct)
    assert fns["args_bytes"]() == ctypes.sizeof(mk.MegakernelArgs) == 8 * (len(mk.MegakernelArgs._fields_) - 1 + 5)
    assert mk.MegakernelArgs._fields_[-1] == ("tunables", mk.MegakernelTunablesStruct)


def test_constants_and_defaults_are_the_librarys(use_lib):
    lib, fns = mk._lib()
    raw = mk.MegakernelConstantsStruct()
    assert fns["constants"](ctypes.byref(raw)) == 0
    c = mk.constants()
    assert dataclasses.asdict(c) == {name: getattr(raw, name) for name, _ in raw._fields_}
    assert (c.block_rows, c.fc1_cols, c.fc2_cols, c.max_experts, c.max_topk, c.first_pull_parts) == (
        128, 128, 256, 1024, 1024, 8)
    assert (c.min_group_blocks, c.max_group_blocks, c.trace_fields, c.max_ctas) == (2, 64, 6, 1024)
    assert c.trace_fields == len(mk.TRACE_FIELDS)
    raw_defaults = mk.MegakernelTunablesStruct()
    assert fns["default_tunables"](ctypes.byref(raw_defaults)) == 0
    assert [getattr(raw_defaults, n) for n, _ in raw_defaults._fields_] == [0, 0, 0, 1, 8]
    assert mk.default_tunables() == {"pairs": True, "group_blocks": 8}
    # The Python signatures' defaults are the library's.
    defaults = mk.default_tunables()
    for fn in (mk.launch_forward, mk.megakernel_forward, mk.check_forward_args, mk.plan_item):
        params = inspect.signature(fn).parameters
        assert params["group_blocks"].default == defaults["group_blocks"], fn.__name__
        if "pairs" in params and fn is not mk.plan_item:
            assert params["pairs"].default == defaults["pairs"], fn.__name__
    # Header words of the counters (plan.cuh), then three counters per ring slot.
    assert mk.counter_words(8192) == 8 + 3 * 64
    assert mk.trace_records(1024, 512, 256) == 8 * (2 * (2 + 2) + 1 + 8) + 1024


def test_null_pointers_are_refused(use_lib):
    _, fns = mk._lib()
    assert fns["constants"](None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["default_tunables"](None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["forward"](None, None) == MOK_ERR_INVALID_ARGUMENT


_TUNABLE_NAMES = [f[0] for f in mk.MegakernelTunablesStruct._fields_]


def _valid_args(**over):
    p = 0x10000  # never dereferenced: the argument checks fail before any CUDA call
    a = dict(bases=p, signal_bases=p, rows_offset=0, scalars_offset=1024, slots_offset=4096, table=p,
             offsets=p, counts=p, topk_ids=p, fc1_weight=p, fc2_weight=p, ring_x=p, ring_h=p, ring_w=p,
             counters=p, y=p, epoch_counter=p, status=p, timeout_ns=10 ** 9, P=2, rank=0, L=4, H=1024,
             I=512, K=2, T=64, ring_rows=512, L1=4)
    t = dict(comm_ctas=2, num_ctas=0, minibatch_rows=256, pairs=0, group_blocks=8)
    for k, v in over.items():
        (t if k in _TUNABLE_NAMES else a)[k] = v
    return mk.MegakernelArgs(**a, tunables=mk.MegakernelTunablesStruct(**t))


@pytest.mark.parametrize("over", [
    dict(H=1000), dict(I=192), dict(L=0), dict(L=2000), dict(rank=2), dict(P=0), dict(P=1025, rank=0),
    dict(minibatch_rows=200), dict(minibatch_rows=0), dict(ring_rows=256), dict(ring_rows=640), dict(comm_ctas=1),
    dict(comm_ctas=0), dict(num_ctas=2), dict(num_ctas=-1), dict(timeout_ns=0), dict(table=0), dict(y=0),
    dict(rows_offset=8), dict(ring_x=0x10008), dict(trace=0x10000, trace_capacity=0), dict(save_x=0x10000),
    dict(save_x=0x10000, save_w=0x10000), dict(save_x=0x10000, save_w=0x10000, save_gu=0x10008),
    dict(L1=3), dict(fc1_weight2=0x10000, L1=3), dict(fc1_weight2=0x10000, fc2_weight2=0x10000),
    dict(fc1_weight2=0x10000, fc2_weight2=0x10000, L1=0), dict(fc1_weight2=0x10008, fc2_weight2=0x10000, L1=3),
    dict(pairs=2), dict(pairs=-1),
    dict(save_rows=128), dict(save_x=0x10000, save_w=0x10000, save_gu=0x10000, save_rows=100),
    dict(save_x=0x10000, save_w=0x10000, save_gu=0x10000, save_rows=-128),
    dict(group_blocks=0), dict(group_blocks=1), dict(group_blocks=3), dict(group_blocks=66), dict(group_blocks=-2),
], ids=lambda over: ",".join(f"{k}={v}" for k, v in over.items()))
def test_c_abi_rejects_bad_arguments_before_any_cuda_call(use_lib, over):
    _, fns = mk._lib()
    args = _valid_args(**over)
    assert fns["forward"](ctypes.byref(args), None) == MOK_ERR_INVALID_ARGUMENT


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches with fake pointers where a GPU would run them")
@pytest.mark.parametrize("group_blocks", [2, 8, 16, 64])
def test_c_abi_takes_valid_tunables_past_its_checks(use_lib, group_blocks):
    # Without a GPU the launch fails at its first CUDA step, not at the argument checks.
    _, fns = mk._lib()
    for pairs in (0, 1):
        args = _valid_args(group_blocks=group_blocks, pairs=pairs)
        assert fns["forward"](ctypes.byref(args), None) not in (0, MOK_ERR_INVALID_ARGUMENT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches with fake pointers where a GPU would run them")
@pytest.mark.parametrize("save_rows", [0, 128, 1 << 20])
def test_c_abi_takes_a_kept_prefix_of_any_whole_blocks(use_lib, save_rows):
    # Training copies with any multiple of 128 rows (0: nothing kept) pass the argument checks.
    _, fns = mk._lib()
    args = _valid_args(save_x=0x10000, save_w=0x10000, save_gu=0x10000, save_rows=save_rows)
    assert fns["forward"](ctypes.byref(args), None) not in (0, MOK_ERR_INVALID_ARGUMENT)


# ---- the op's Python checks and fake ----------------------------------------------------------

def _op_args(R=512, L=4, H=1024, I=512, T=6, K=2, P=2, words=None):
    z = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype)
    return dict(
        bases=z(P, dtype=torch.int64), signal_bases=z(P, dtype=torch.int64), rows_offset=0, scalars_offset=0,
        slots_offset=0, table=z(100, 2, dtype=torch.int32), offsets=z(L + 1, dtype=torch.int32),
        counts=z(L, dtype=torch.int32), topk_ids=z(T, K, dtype=torch.int64), fc1_weight=z(L, 2 * I, H),
        fc2_weight=z(L, H, I), ring_x=z(R, H), ring_h=z(R, I), ring_w=z(R, dtype=torch.float32),
        counters=z(words if words is not None else mk.counter_words(R), dtype=torch.int32),
        epoch_counter=z(1, dtype=torch.int64), status=z(8, dtype=torch.int32), rank=0, minibatch_rows=256,
        comm_ctas=2, num_ctas=0, timeout_ns=10 ** 9, trace=None, save_x=None, save_w=None, save_gu=None,
        fc1_weight2=None, fc2_weight2=None)


def test_fake_impl_gives_the_output_shape(use_lib):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = _op_args(T=37, H=1024)
        y = torch.ops.mok.megakernel_forward(**a)
        assert y.shape == (37, 1024) and y.dtype == torch.bfloat16
        y = torch.ops.mok.megakernel_forward(**a, pairs=False, group_blocks=16)
        assert y.shape == (37, 1024)


_CHECK_KEYS = ("bases", "signal_bases", "table", "offsets", "counts", "topk_ids", "fc1_weight", "fc2_weight",
               "ring_x", "ring_h", "ring_w", "counters", "epoch_counter", "status")


@pytest.mark.parametrize("over,message", [
    (dict(ring_h=torch.zeros(512, 256, dtype=torch.bfloat16)), r"ring_h must have shape \(512, 512\)"),
    (dict(ring_x=torch.zeros(640, 1024, dtype=torch.bfloat16), ring_h=torch.zeros(640, 512, dtype=torch.bfloat16),
          ring_w=torch.zeros(640)), r"ring_rows = 640 must be a multiple of minibatch_rows = 256"),
    (dict(minibatch_rows=100), r"minibatch_rows = 100 must be a positive multiple of 128"),
    (dict(counters=torch.zeros(7, dtype=torch.int32)), r"counters must have 20 elements"),
    (dict(comm_ctas=1), r"comm_ctas = 1 must be at least 2"),
    (dict(num_ctas=2), r"num_ctas = 2 must be 0 \(every SM\) or above comm_ctas = 2"),
    (dict(rank=2), r"rank = 2 is outside \[0, P = 2\)"),
    (dict(status=torch.zeros(4, dtype=torch.int32)), r"status must have 8 elements"),
    (dict(fc1_weight=torch.zeros(4, 1024, 1000, dtype=torch.bfloat16),
          fc2_weight=torch.zeros(4, 1000, 512, dtype=torch.bfloat16)), r"H = 1000 must be a multiple of 256"),
    (dict(topk_ids=torch.zeros(6, 2, dtype=torch.int32)), r"topk_ids must be torch.int64"),
    (dict(topk_ids=torch.zeros(6, 1025, dtype=torch.int64)), r"top-k = 1025 is outside \[1, 1024\]"),
    (dict(group_blocks=0), r"group_blocks = 0 must be an even number from 2 to 64"),
    (dict(group_blocks=7), r"group_blocks = 7 must be an even number from 2 to 64"),
    (dict(group_blocks=66), r"group_blocks = 66 must be an even number from 2 to 64"),
])
def test_op_checks_name_the_bad_value(use_lib, over, message):
    a = _op_args()
    a.update(over)
    extra = {"group_blocks": a["group_blocks"]} if "group_blocks" in a else {}
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        mk.check_forward_args(*(a[k] for k in _CHECK_KEYS), rank=a["rank"], minibatch_rows=a["minibatch_rows"],
                              comm_ctas=a["comm_ctas"], num_ctas=a["num_ctas"], timeout_ns=a["timeout_ns"], **extra)
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        torch.ops.mok.megakernel_forward(**a)


def test_op_checks_take_every_valid_group_size(use_lib):
    a = _op_args()
    c = mk.constants()
    for group_blocks in range(c.min_group_blocks, c.max_group_blocks + 1, 2):
        mk.check_forward_args(*(a[k] for k in _CHECK_KEYS), rank=0, minibatch_rows=256, comm_ctas=2, num_ctas=0,
                              timeout_ns=10 ** 9, group_blocks=group_blocks)


def _saves(x_rows, w_rows=None, gu_rows=None, H=1024, two_i=1024):
    """Training copies of x_rows rows (save_w and save_gu: w_rows and gu_rows when given)."""
    w_rows = x_rows if w_rows is None else w_rows
    gu_rows = x_rows if gu_rows is None else gu_rows
    return dict(save_x=torch.zeros(x_rows, H, dtype=torch.bfloat16), save_w=torch.zeros(w_rows),
                save_gu=torch.zeros(gu_rows, two_i, dtype=torch.bfloat16))


@pytest.mark.parametrize("over,message", [
    (dict(save_x=torch.zeros(100, 1024, dtype=torch.bfloat16)), r"save_x, save_w and save_gu go together.*save_x only"),
    (_saves(100, two_i=512), r"save_gu must have shape \(100, 1024\)"),
    (_saves(256, H=512), r"save_x must have shape \(256, 1024\)"),
    # The kept prefix's row count is save_x's; the other two must agree with it.
    (_saves(99, w_rows=100, gu_rows=100), r"save_w must have shape \(99,\), got \(100,\)"),
    (_saves(256, gu_rows=128), r"save_gu must have shape \(256, 1024\), got \(128, 1024\)"),
    (_saves(128, w_rows=256), r"save_w must have shape \(128,\), got \(256,\)"),
    (dict(_saves(100), save_w=torch.zeros(100, dtype=torch.float64)), r"save_w must be torch.float32"),
    # Whole row blocks, or the table's R_cap = 100 rows (every row).
    (_saves(200), r"the training copies' 200 rows must be a multiple of 128 .* or the table's R_cap = 100 rows"),
    (_saves(64), r"the training copies' 64 rows must be a multiple of 128"),
])
def test_training_copies_are_checked(use_lib, over, message):
    a = _op_args()
    a.update(over)
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        mk.check_save_args(a["save_x"], a["save_w"], a["save_gu"], a["table"], a["fc1_weight"])
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        torch.ops.mok.megakernel_forward(**a)


@pytest.mark.parametrize("rows", [0, 128, 256, 384, 100])
def test_training_copies_of_a_prefix_pass_the_checks(use_lib, rows):
    # Any multiple of 128 rows, 0 (nothing kept) or R_cap = 100 (the table's rows: every row).
    a = _op_args()
    a.update(_saves(rows))
    mk.check_save_args(a["save_x"], a["save_w"], a["save_gu"], a["table"], a["fc1_weight"])


@pytest.mark.parametrize("rows,want", [(None, 0), (0, 0), (256, 256), (100, 0), (300, 256)])
def test_launch_passes_the_kept_rows_to_the_library(use_lib, monkeypatch, rows, want):
    """launch_forward passes save_x's row count, rounded down to whole blocks (R_cap keeps every
    row of the layout, which ends at a multiple of 128 at most R_cap), and null copies with it
    when no whole block is kept."""
    lib, fns = mk._lib()
    seen = []
    fns = dict(fns, forward=lambda args, stream: seen.append(args._obj) or 0)
    monkeypatch.setattr(mk, "_lib", lambda: (lib, fns))
    monkeypatch.setattr(mk, "stream_of", lambda t: None)
    a = _op_args()
    if rows is not None:
        a.update(_saves(rows))
    mk.launch_forward(**a)
    (args,) = seen
    assert args.save_rows == want
    assert bool(args.save_x) == bool(args.save_w) == bool(args.save_gu) == (want > 0)
    if want:
        names = ("save_x", "save_w", "save_gu")
        assert tuple(getattr(args, k) for k in names) == tuple(a[k].data_ptr() for k in names)


def test_launch_takes_the_ops_arguments():
    # Callers (and the GPU tests) pass one set of named arguments to either.
    assert list(inspect.signature(mk.launch_forward).parameters) == list(
        inspect.signature(mk.megakernel_forward.impl).parameters)


_SEG = dict(fc1_weight2=torch.zeros(1, 1024, 1024, dtype=torch.bfloat16),
            fc2_weight2=torch.zeros(1, 1024, 512, dtype=torch.bfloat16),
            offsets=torch.zeros(6, dtype=torch.int32), counts=torch.zeros(5, dtype=torch.int32))


@pytest.mark.parametrize("over,message", [
    (dict(_SEG, fc2_weight2=None), r"fc1_weight2 and fc2_weight2 go together.*only fc1_weight2"),
    (dict(_SEG, fc2_weight2=torch.zeros(1, 1024, 256, dtype=torch.bfloat16)),
     r"fc2_weight2 must have shape \(1, 1024, 512\)"),
    (dict(_SEG, fc1_weight2=torch.zeros(2, 1024, 512, dtype=torch.bfloat16)),
     r"fc1_weight2 must have shape \(2, 1024, 1024\)"),
    (dict(_SEG, offsets=torch.zeros(5, dtype=torch.int32)), r"offsets must have 6 elements"),
    (dict(_SEG, counts=torch.zeros(4, dtype=torch.int32)), r"counts must have 5 elements"),
])
def test_second_weight_segment_is_checked(use_lib, over, message):
    a = _op_args()
    a.update(over)
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        torch.ops.mok.megakernel_forward(**a)


def test_fake_impl_takes_a_second_weight_segment(use_lib):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = _op_args(T=37, H=1024)
        a.update(fc1_weight2=torch.zeros(1, 1024, 1024, dtype=torch.bfloat16),
                 fc2_weight2=torch.zeros(1, 1024, 512, dtype=torch.bfloat16))
        y = torch.ops.mok.megakernel_forward(**a)
        assert y.shape == (37, 1024) and y.dtype == torch.bfloat16


# ---- the backend's rules and tunables ---------------------------------------------------------

@pytest.mark.parametrize("shape,config,message", [
    (KIMI, MoKConfig(), None),
    (MoEShape(1, 1024, 1, 1, 128), MoKConfig(), None),
    (KIMI, MoKConfig(tile_rows=64), "tile_rows=64; the megakernel's row blocks are 128 rows"),
    (MoEShape(64, 1000, 2, 4, 512), MoKConfig(), "hidden size 1000 is not a multiple of 256"),
    (MoEShape(64, 1024, 2, 4, 192), MoKConfig(), "expert FFN size 192 is not a multiple of 128"),
    (MoEShape(64, 1024, 2, 2000, 512), MoKConfig(), "2000 experts per rank exceed the megakernel's 1024"),
    (MoEShape(64, 1024, 1025, 4, 512), MoKConfig(), "top-k 1025 exceeds the megakernel's 1024"),
])
def test_shape_rules(use_lib, shape, config, message):
    reason = mkb.unsupported_reason(shape, config, 1)
    if message is None:
        assert reason is None
    else:
        assert reason is not None and message in reason


def test_explicit_megakernel_on_cpu_says_why():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ids = torch.zeros(4, 1, dtype=torch.int64)
    w = torch.ones(4, 1)
    fc1 = torch.zeros(1, 256, 256, dtype=torch.bfloat16)
    fc2 = torch.zeros(1, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="backend='megakernel' cannot run: the tensors are on cpu"):
        mok_moe(x, ids, w, fc1, fc2, backend="megakernel")


def test_selection_auto_takes_the_megakernel_and_logs_one_line_when_it_cannot(use_lib, monkeypatch, caplog):
    # Stand-ins for a working GPU stack: only the backends' own shape rules decide.
    monkeypatch.setattr(mkb, "gpu_unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(cuda_backend, "gpu_unavailable_reason", lambda device, dtype: None)

    def spec(shape, config):
        return CallSpec(shape=shape, config=config, ep_group=None, ep_size=2, device=torch.device("cuda", 0),
                        dtype=torch.bfloat16)
    many = MoEShape(4096, 7168, 8, 6, 2048)  # ~5,500 rows per local expert
    for shape in (KIMI, many):  # training and inference alike: there is no grad argument
        assert backends.select_backend("auto", spec(shape, MoKConfig())).name == "megakernel"
    assert backends.select_backend("megakernel", spec(KIMI, MoKConfig())).name == "megakernel"
    with pytest.raises(BackendUnavailable, match="tile_rows=64"):
        backends.select_backend("megakernel", spec(KIMI, MoKConfig(tile_rows=64)))
    backends._log_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="megatron_mok"):
        for _ in range(3):
            assert backends.select_backend("auto", spec(KIMI, MoKConfig(tile_rows=64))).name == "cuda"
    lines = [r.getMessage() for r in caplog.records if "auto uses the cuda backend" in r.getMessage()]
    assert len(lines) == 1 and "tile_rows=64" in lines[0], lines


def test_launch_tunables_default_to_the_librarys(use_lib):
    # MoKConfig.megakernel's None fields take the library's defaults (pairs on, groups of 8);
    # a given value wins; a group size the library refuses is a config error naming the rule.
    assert mkb.resolve_tunables(MoKConfig(), KIMI, 2, 132).megakernel == MegakernelTunables(pairs=True, group_blocks=8)
    given = MoKConfig(megakernel=MegakernelTunables(pairs=False, group_blocks=16))
    assert mkb.resolve_tunables(given, KIMI, 2, 132).megakernel == MegakernelTunables(pairs=False, group_blocks=16)
    only_pairs = MoKConfig(megakernel=MegakernelTunables(pairs=False))
    assert mkb.resolve_tunables(only_pairs, KIMI, 2, 132).megakernel == MegakernelTunables(pairs=False, group_blocks=8)
    with pytest.raises(MoKConfigError, match="group_blocks=66 must be an even number from 2 to 64"):
        mkb.resolve_tunables(MoKConfig(megakernel=MegakernelTunables(group_blocks=66)), KIMI, 2, 132)
    with pytest.raises(MoKConfigError, match="group_blocks"):
        MegakernelTunables(group_blocks=7)


def test_forward_comm_sms_default_follows_the_regime(use_lib):
    # Weight-bound (at most 256 rows per local expert): 6 comm SMs; otherwise 8. Always at most
    # a quarter of the SMs; an explicit value wins; the backward's default stays 10.
    def resolved(experts, config=MoKConfig(), sms=132):
        return mkb.resolve_tunables(config, dataclasses.replace(KIMI, experts_per_rank=experts), 2, sms)
    assert [resolved(e).comm_sms_forward for e in (192, 128, 129, 48, 6)] == [6, 6, 6, 8, 8]
    assert [resolved(e).comm_sms_backward for e in (192, 6)] == [10, 10]
    assert mkb.rows_per_expert(dataclasses.replace(KIMI, experts_per_rank=128)) == 256.0
    assert resolved(192, MoKConfig(comm_sms_forward=12)).comm_sms_forward == 12
    assert resolved(192, sms=20).comm_sms_forward == 5 and resolved(6, sms=20).comm_sms_forward == 5
    # The minibatch heuristic sees the compute SMs left: two waves at 126 as at 124.
    assert resolved(192).minibatch_rows == resolved(6).minibatch_rows == 2048


def test_forward_without_grad_takes_two_comm_sms_fewer_unless_given(use_lib):
    # No training copies: the pulls write each row once, so a forward without grad takes two comm
    # SMs fewer (4 weight-bound, 6 otherwise); with grad the resolved count; an explicit count
    # serves both; never below 2.
    def counts(experts, config=MoKConfig(), sms=132):
        res = mkb.resolve_tunables(config, dataclasses.replace(KIMI, experts_per_rank=experts), 2, sms)
        return (config.forward_comm_sms(res, saves_activations=True),
                config.forward_comm_sms(res, saves_activations=False))
    assert [counts(e) for e in (192, 128, 48, 6)] == [(6, 4), (6, 4), (8, 6), (8, 6)]
    assert counts(192, MoKConfig(comm_sms_forward=12)) == (12, 12)
    assert counts(6, MoKConfig(comm_sms_forward=3)) == (3, 3)
    assert counts(192, sms=12) == (3, 2) and counts(192, sms=8) == (2, 2)
    with pytest.raises(MoKConfigError, match="needs the resolved config"):
        MoKConfig().forward_comm_sms(MoKConfig(), saves_activations=False)


def test_tunables_resolve_within_the_rules(use_lib):
    cfg = mkb.resolve_tunables(MoKConfig(), KIMI, 2, 132)
    assert cfg.comm_sms_forward == 6 and cfg.minibatch_rows % 128 == 0 and cfg.ring_rows == 4 * cfg.minibatch_rows
    one = mkb.resolve_tunables(MoKConfig(), KIMI, 1, 132)
    assert one.comm_sms_forward == 6  # the same rows move at P = 1 (local copies)
    # A virtual rank's share of the SMs (LocalEPGroup of 4 on 132 SMs).
    share = mkb.resolve_tunables(MoKConfig(), KIMI, 4, 33)
    assert share.comm_sms_forward == 6 and share.minibatch_rows >= 128
    given = mkb.resolve_tunables(MoKConfig(comm_sms_forward=3, minibatch_rows=256, ring_rows=768), KIMI, 2, 132)
    assert (given.comm_sms_forward, given.minibatch_rows, given.ring_rows) == (3, 256, 768)


@pytest.mark.parametrize("kwargs,num_sms,message", [
    (dict(comm_sms_forward=33), 33, r"comm_sms_forward=33 leaves no compute SM on a device with 33 SMs"),
    (dict(minibatch_rows=256, ring_rows=256), 132,
     r"ring_rows=256 must be a multiple of minibatch_rows=256 and at least two"),
    (dict(minibatch_rows=256, ring_rows=640), 132, r"ring_rows=640 must be a multiple of minibatch_rows=256"),
    (dict(minibatch_rows=200), 132, r"minibatch_rows=200 must be a multiple of tile_rows=128"),
    (dict(), 2, r"needs at least 3 SMs"),
    (dict(comm_sms_forward=1), 132, r"comm_sms_forward=1 must be None \(chosen automatically\) or an integer >= 2"),
])
def test_bad_tunables_are_clear_errors(use_lib, kwargs, num_sms, message):
    with pytest.raises(MoKConfigError, match=message):
        mkb.resolve_tunables(MoKConfig(**kwargs), KIMI, 2, num_sms)


def test_ring_to_minibatch_rule_applies_to_defaults_too(use_lib):
    # ring_rows given, minibatch_rows chosen: the combination is still checked after resolution.
    with pytest.raises(MoKConfigError, match="ring_rows=1024 must be a multiple of minibatch_rows"):
        mkb.resolve_tunables(MoKConfig(ring_rows=1024), KIMI, 2, 132)  # default minibatch is 2048 rows here


def test_ring_memory_is_fixed_by_the_config():
    # Kimi-K2 defaults: a ring of 8192 rows, whatever the routing.
    assert mkb.ring_bytes(8192, 7168, 2048) == 8192 * (7168 + 2048) * 2 + 8192 * 4
    assert mkb.ring_bytes(8192, 7168, 2048) < 160 * 2 ** 20


# ---- the backend's host path, with the GPU steps recorded instead of queued -----------------

class _RecordingWorkspace:
    """The parts of a Workspace the megakernel backend's host path touches, on the CPU; dispatch
    returns a schedule of the call's shape instead of queueing the prologue."""

    def __init__(self, P, rank, shape):
        from types import SimpleNamespace

        self.P, self.rank, self.device = P, rank, torch.device("cpu")
        self.layout = SimpleNamespace(hidden=shape.hidden, rows=1024, scalars=512, slots=4096)
        self.bases = torch.zeros(P, dtype=torch.int64)
        self.signal_bases = torch.zeros(P, dtype=torch.int64)
        self.counter = torch.zeros(1, dtype=torch.int64)
        self.status = torch.zeros(8, dtype=torch.int32)
        self.timeout_s = float("nan")
        self.capacity = P * shape.tokens * shape.topk + shape.experts_per_rank * 127
        self.experts = shape.experts_per_rank
        self.dispatched = []

    def raise_if_failed(self, timeout_s):
        pass

    def dispatch(self, x, ids, scalars, site, timeout_s, tile_rows):
        self.dispatched.append((x.shape, ids.shape, scalars.shape, site, timeout_s, tile_rows))
        L = self.experts
        return (torch.zeros((self.capacity, 2), dtype=torch.int32), torch.zeros(L, dtype=torch.int32),
                torch.zeros(L + 1, dtype=torch.int32), self.capacity)

    def mirror_status(self):
        pass


class _TwoRankGroup:
    """Stands for rank 1 of a two-rank process group (size() and rank(), hashable)."""

    def size(self):
        return 2

    def rank(self):
        return 1


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("tunables", [MegakernelTunables(), MegakernelTunables(pairs=False, group_blocks=16)],
                         ids=["defaults", "given"])
def test_backend_host_path_prepares_once_and_passes_the_launch_settings(use_lib, monkeypatch, grad, tunables):
    shape = MoEShape(tokens=64, hidden=1024, topk=2, experts_per_rank=4, ffn_hidden=512)
    ws = _RecordingWorkspace(2, 1, shape)
    group = _TwoRankGroup()
    monkeypatch.setattr(mkb, "get_workspace", lambda *a, **kw: ws)
    monkeypatch.setattr(mkb, "sm_share", lambda device, ep_group: 132)
    checked, kernel_calls = [], []
    real_check = mk.check_forward_args
    monkeypatch.setattr(mk, "check_forward_args", lambda *a, **kw: checked.append(kw) or real_check(*a, **kw))
    monkeypatch.setattr(mk, "launch_forward",
                        lambda *a, **kw: kernel_calls.append((a, kw)) or torch.zeros(shape.tokens, shape.hidden))
    config = MoKConfig(timeout_s=7.0, megakernel=tunables)
    spec = CallSpec(shape=shape, config=config, ep_group=group, ep_size=2, device=torch.device("cpu"),
                    dtype=torch.bfloat16)
    x = torch.zeros(shape.tokens, shape.hidden, dtype=torch.bfloat16, requires_grad=grad)
    ids = torch.zeros(shape.tokens, shape.topk, dtype=torch.int64)
    w = torch.zeros(shape.tokens, shape.topk)
    fc1 = (torch.zeros(4, 1024, 1024, dtype=torch.bfloat16),)
    fc2 = (torch.zeros(4, 1024, 512, dtype=torch.bfloat16),)
    for _ in range(3):
        y = mkb.MegakernelBackend().run(spec, x, ids, w, fc1, fc2)
        assert y.shape == (shape.tokens, shape.hidden)
    assert len(checked) == 1, "a (config, shape) is prepared and checked at its first call only"
    assert checked[0]["group_blocks"] == (tunables.group_blocks or mk.default_tunables()["group_blocks"])
    assert len(ws.dispatched) == 3 and ws.dispatched[0] == ((64, 1024), (64, 2), (64, 2), 1, 7.0, 128)
    resolved = mkb.resolve_tunables(config, shape, 2, 132)
    assert len(kernel_calls) == 3
    args, kw = kernel_calls[-1]
    names = ["bases", "signal_bases", "rows_offset", "scalars_offset", "slots_offset", "table", "offsets", "counts",
             "topk_ids", "fc1", "fc2", "ring_x", "ring_h", "ring_w", "counters", "epoch_counter", "status", "rank",
             "minibatch_rows", "comm_ctas", "num_ctas", "timeout_ns", "trace", "save_x", "save_w", "save_gu",
             "fc1_2", "fc2_2"]
    a = dict(zip(names, args))
    assert (a["rows_offset"], a["scalars_offset"], a["slots_offset"], a["rank"]) == (1024, 512, 4096, 1)
    assert a["minibatch_rows"] == resolved.minibatch_rows and a["ring_x"].shape == (resolved.ring_rows, 1024)
    want_comm = resolved.comm_sms_forward if grad else config.forward_comm_sms(resolved, saves_activations=False)
    assert a["comm_ctas"] == want_comm and a["num_ctas"] == 0 and a["timeout_ns"] == 7 * 10 ** 9
    assert a["table"].shape == (ws.capacity, 2) and a["offsets"].shape == (5,) and a["trace"] is None
    assert (a["save_x"] is not None) == grad and (grad or a["save_gu"] is None)
    if grad:  # a kept prefix of the layout (whole blocks, at most every row), as the op takes it
        mk.check_save_args(a["save_x"], a["save_w"], a["save_gu"], a["table"], a["fc1"])
        assert 0 < a["save_x"].shape[0] <= ws.capacity and a["save_gu"].shape[1] == 1024
    want = mk.default_tunables()
    want.update({k: v for k, v in dataclasses.asdict(tunables).items() if v is not None})
    assert kw == want
    assert ws.timeout_s == 7.0
