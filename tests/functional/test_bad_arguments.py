"""A sweep of bad arguments through the public API (``mok_moe``, ``MoKConfig``,
``MegakernelTunables``, ``check_errors``, ``LocalEPGroup``), on the CPU: every case gives a clear
MoK error (or TypeError / ValueError for the API's own constructors) naming the argument and what
is supported, never an internal error from deep inside; layouts MoK accepts (strided views, no
tokens, NaN router weights) give the right result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_mok import MegakernelTunables, MoKConfig, MoKConfigError
from megatron_mok.functional import BackendUnavailable, LocalEPGroup, MoKInputError, check_errors, mok_moe
from megatron_mok.reference import dense_moe

from tests.cases import make_case

T, H, I, L, K = 6, 8, 4, 3, 2
CASE = make_case(0, [T], H, I, L, K, dtype=torch.float32)
NAMES = ("x", "topk_ids", "topk_weights", "fc1_weight", "fc2_weight")


def _args():
    return dict(x=CASE.x[0].clone(), topk_ids=CASE.ids[0].clone(), topk_weights=CASE.weights[0].clone(),
                fc1_weight=CASE.fc1_all.clone(), fc2_weight=CASE.fc2_all.clone())


def _huge(name):
    """Arguments with 2^31 tokens (expanded views: no memory)."""
    a = _args()
    n = 2 ** 31
    a["x"] = a["x"][:1].expand(n, H)
    a["topk_ids"] = a["topk_ids"][:1].expand(n, K)
    a["topk_weights"] = a["topk_weights"][:1].expand(n, K)
    return a[name]


# (argument, bad value (or a function of the good one), the error, its message)
BAD_TENSOR_ARGUMENTS = [
    # wrong types
    *[(name, value, MoKInputError, rf"{name} must be a torch.Tensor, got {kind}")
      for name in ("x", "topk_ids", "topk_weights")
      for value, kind in ((None, "NoneType"), ([[1.0, 2.0]], "list"), (np.zeros((T, K)), "ndarray"), (3, "int"))],
    *[(name, value, MoKInputError, rf"{name} must be a torch.Tensor or a tuple of 1 to 2 tensors .*got {kind}")
      for name in ("fc1_weight", "fc2_weight")
      for value, kind in ((None, "NoneType"), (np.zeros((L, 2 * I, H)), "ndarray"), (3, "int"), ("w", "str"))],
    ("fc1_weight", lambda w: [w.tolist()], MoKInputError, r"fc1_weight\[0\] must be a torch.Tensor, got list"),
    ("fc2_weight", lambda w: (w, w, w), MoKInputError, r"a tuple of 1 to 2 tensors .* got tuple of length 3"),
    ("fc2_weight", lambda w: (), MoKInputError, r"got tuple of length 0"),
    # dimensions and shapes
    ("x", lambda x: x[0], MoKInputError, r"x has shape \(8,\); it must be 2-D \[T, H\]"),
    ("x", lambda x: x[None], MoKInputError, r"x has shape \(1, 6, 8\); it must be 2-D"),
    ("x", lambda x: x[:, :0], MoKInputError, r"the hidden size H \(its second dimension\) must be at least 1"),
    ("x", lambda x: x[:5], MoKInputError, r"x is \(5, 8\) but topk_ids is \(6, 2\)"),
    ("topk_ids", lambda t: t.reshape(-1), MoKInputError, r"topk_ids has shape \(12,\); it must be 2-D \[T, K\]"),
    ("top-k 0", lambda a: a.update(topk_ids=a["topk_ids"][:, :0], topk_weights=a["topk_weights"][:, :0]),
     MoKInputError, r"top-k is 0 \(topk_ids is \(6, 0\)\); it must be at least 1"),
    ("topk_weights", lambda w: w[:, :1], MoKInputError, r"topk_weights is \(6, 1\)"),
    ("fc1_weight", lambda w: w[0], MoKInputError, r"fc1_weight has shape \(8, 8\); it must be 3-D \[E/P, 2I, H\]"),
    ("fc1_weight", lambda w: w[:0], MoKInputError, r"fc1_weight holds no experts"),
    ("fc1_weight", lambda w: w[:, :7], MoKInputError, r"even, non-zero 2I"),
    ("fc1_weight", lambda w: w[:, :0], MoKInputError, r"even, non-zero 2I"),
    ("fc1_weight", lambda w: w[:, :, :4], MoKInputError, r"it must be \[E/P, 2I, H\] with H = 8"),
    ("fc2_weight", lambda w: w[:2], MoKInputError, r"fc2_weight is \(2, 8, 4\); it must be \[E/P, H, I\] = \(3, 8, 4\)"),
    ("fc2_weight", lambda w: w[:, :, :3], MoKInputError, r"= \(3, 8, 4\) to match fc1_weight"),
    # dtypes
    ("x", lambda x: x.int(), MoKInputError, r"x has dtype torch.int32; supported: "),
    ("x", lambda x: x.to(torch.complex64), MoKInputError, r"x has dtype torch.complex64; supported: "),
    ("topk_ids", lambda t: t.int(), MoKInputError, r"topk_ids has dtype torch.int32; it must be torch.int64"),
    ("topk_ids", lambda t: t.float(), MoKInputError, r"topk_ids has dtype torch.float32; it must be torch.int64"),
    ("topk_ids", lambda t: t.float().requires_grad_(), MoKInputError, r"topk_ids has dtype torch.float32"),
    ("topk_ids", lambda t: t > 0, MoKInputError, r"topk_ids has dtype torch.bool; it must be torch.int64"),
    ("topk_weights", lambda w: w.bfloat16(), MoKInputError, r"topk_weights has dtype torch.bfloat16; it must be "
                                                            r"torch.float32$"),
    ("topk_weights", lambda w: w.double(), MoKInputError, r"topk_weights has dtype torch.float64"),
    ("topk_weights", lambda w: w.long(), MoKInputError, r"topk_weights has dtype torch.int64"),
    ("fc1_weight", lambda w: w.double(), MoKInputError, r"fc1_weight has dtype torch.float64 but x has torch.float32"),
    ("fc2_weight", lambda w: w.half(), MoKInputError, r"fc2_weight has dtype torch.float16 but x has torch.float32"),
    # layouts and devices
    ("x", lambda x: x.to_sparse(), MoKInputError, r"x has layout torch.sparse_coo; MoK takes dense tensors"),
    ("topk_ids", lambda t: t.to_sparse(), MoKInputError, r"topk_ids has layout torch.sparse_coo"),
    ("fc2_weight", lambda w: w.to_sparse(), MoKInputError, r"fc2_weight has layout torch.sparse_coo"),
    ("topk_weights", lambda w: w.to("meta"), MoKInputError, r"all arguments must be on one device, got \['cpu', "
                                                            r"'meta'\]"),
    ("fc1_weight", lambda w: w.to("meta"), MoKInputError, r"all arguments must be on one device"),
    # sizes past what MoK indexes
    ("huge", None, MoKInputError, r"2147483648 tokens x top-k 2 = 4294967296 routes on this rank; MoK indexes "
                                  r"routes with int32"),
]


@pytest.mark.parametrize("name,bad,error,message", BAD_TENSOR_ARGUMENTS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_TENSOR_ARGUMENTS)])
def test_bad_tensor_arguments_are_clear_errors(name, bad, error, message):
    args = _args()
    if name == "huge":
        args.update({n: _huge(n) for n in ("x", "topk_ids", "topk_weights")})
    elif name not in args:  # a change of several arguments
        bad(args)
    else:
        args[name] = bad(args[name]) if callable(bad) else bad
    with pytest.raises(error, match=message):
        mok_moe(**args, backend="reference")


def test_every_argument_on_the_meta_device_is_a_clear_error():
    args = {n: t.to("meta") for n, t in _args().items()}
    with pytest.raises(MoKInputError, match="meta device, which holds no data"):
        mok_moe(**args)


BAD_OTHER_ARGUMENTS = [
    ("ep_group", "world", MoKInputError, r"ep_group='world' \(str\) is not supported; pass None \(one rank\), the "
                                         r"expert-parallel torch.distributed.ProcessGroup"),
    ("ep_group", 2, MoKInputError, r"ep_group=2 \(int\) is not supported"),
    ("ep_group", [0, 1], MoKInputError, r"ep_group=\[0, 1\] \(list\) is not supported"),
    ("ep_group", dist.GroupMember.NON_GROUP_MEMBER, MoKInputError,
     r"this rank is not a member of the process group \(torch.distributed.new_group returns that"),
    ("config", {"tile_rows": 4}, MoKConfigError, r"config must be a MoKConfig or None, got dict"),
    ("config", MegakernelTunables(), MoKConfigError, r"config must be a MoKConfig or None, got MegakernelTunables"),
    ("config", 4, MoKConfigError, r"got int"),
    ("backend", None, MoKInputError, r"backend=None \(NoneType\) is not one of \('auto', 'reference', 'cuda', "
                                     r"'megakernel'\)"),
    ("backend", "fast", MoKInputError, r"backend='fast' is not one of"),
    ("backend", ["cuda"], MoKInputError, r"backend=\['cuda'\] \(list\) is not one of"),
    ("backend", np.array(["cuda"]), MoKInputError, r"\(ndarray\) is not one of"),
    ("backend", "cuda", BackendUnavailable, r"backend='cuda' cannot run: the tensors are on cpu, and the CUDA "
                                            r"backends need a CUDA device"),
    ("backend", "megakernel", BackendUnavailable, r"backend='megakernel' cannot run: the tensors are on cpu"),
    ("config", MoKConfig(num_experts=4), MoKConfigError, r"num_experts=4 over 1 ranks gives 4 experts per rank, but "
                                                         r"the expert weights hold 3"),
]


@pytest.mark.parametrize("name,bad,error,message", BAD_OTHER_ARGUMENTS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_OTHER_ARGUMENTS)])
def test_bad_keyword_arguments_are_clear_errors(name, bad, error, message):
    kwargs = dict(backend="reference")
    kwargs[name] = bad
    with pytest.raises(error, match=message):
        mok_moe(**_args(), **kwargs)


BAD_CONFIGS = [
    (dict(tile_rows="128"), r"tile_rows='128' is not supported; it must be a power of two between 1 and 256"),
    (dict(tile_rows=128.0), r"tile_rows=128.0 is not supported"),
    (dict(tile_rows=None), r"tile_rows=None is not supported"),
    (dict(tile_rows=-4), r"tile_rows=-4"),
    (dict(tile_rows=512), r"tile_rows=512"),
    (dict(timeout_s=True), r"timeout_s=True must be a positive finite number of seconds"),
    (dict(timeout_s="5"), r"timeout_s='5' must be"),
    (dict(timeout_s=None), r"timeout_s=None must be"),
    (dict(timeout_s=-1.0), r"timeout_s=-1.0 must be"),
    (dict(timeout_s=float("nan")), r"timeout_s=nan must be"),
    (dict(comm_sms_forward="4"), r"comm_sms_forward='4' must be None \(chosen automatically\) or an integer >= 2"),
    (dict(comm_sms_forward=3.5), r"comm_sms_forward=3.5 must be None"),
    (dict(comm_sms_backward=True), r"comm_sms_backward=True must be None"),
    (dict(minibatch_rows=0), r"minibatch_rows=0 must be None"),
    (dict(ring_rows=-1), r"ring_rows=-1 must be None"),
    (dict(max_tokens_per_rank=0), r"max_tokens_per_rank=0 must be None"),
    (dict(max_tokens_per_rank=2 ** 31), r"max_tokens_per_rank=2147483648 is above 2147483647: the kernels count a "
                                        r"rank's tokens in int32"),
    (dict(max_tokens_per_rank=np.int64(8)), r"max_tokens_per_rank=.*8.* must be None \(chosen automatically\) or an "
                                            r"integer"),
    (dict(num_experts="8"), r"num_experts='8' must be None"),
    (dict(megakernel=None), r"MoKConfig.megakernel=None must be a MegakernelTunables"),
    (dict(megakernel={"pairs": False}), r"must be a MegakernelTunables"),
]


@pytest.mark.parametrize("kwargs,message", BAD_CONFIGS, ids=[f"{next(iter(c[0]))}-{i}" for i, c in
                                                             enumerate(BAD_CONFIGS)])
def test_bad_config_fields_are_clear_errors(kwargs, message):
    with pytest.raises(MoKConfigError, match=message):
        MoKConfig(**kwargs)


def test_unknown_config_field_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'tile_row'"):
        MoKConfig(tile_row=64)
    with pytest.raises(MoKConfigError, match="pairs='yes' must be None"):
        MegakernelTunables(pairs="yes")


@pytest.mark.parametrize("bad,error,message", [
    (0, ValueError, r"LocalEPGroup size=0 must be an integer of at least 1"),
    (-2, ValueError, r"size=-2"),
    ("2", ValueError, r"size='2'"),
    (2.0, ValueError, r"size=2.0"),
    (True, ValueError, r"size=True"),
    (None, ValueError, r"size=None"),
])
def test_bad_local_ep_group_sizes_are_clear_errors(bad, error, message):
    with pytest.raises(error, match=message):
        LocalEPGroup(bad)


def test_local_ep_group_devices_and_no_gpu_are_clear_errors():
    with pytest.raises(ValueError, match=r"device='cpu': virtual ranks run the GPU backends, on a CUDA device"):
        LocalEPGroup(2, device="cpu")
    with pytest.raises(TypeError, match=r"device=\[0\] \(list\) must be None"):
        LocalEPGroup(2, device=[0])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="LocalEPGroup needs a CUDA device .* run P ranks as processes with "
                                               "the reference backend"):
            LocalEPGroup(2)


def test_check_errors_with_a_bad_group_is_a_type_error():
    with pytest.raises(TypeError, match=r"ep_group='world' \(str\) is not supported"):
        check_errors("world")
    check_errors(None)  # nothing recorded in this process: nothing raised


def _leaf_args():
    return {n: (t.clone().requires_grad_() if n != "topk_ids" else t.clone()) for n, t in _args().items()}


def _run(args):
    y = mok_moe(**args, backend="reference", config=MoKConfig(tile_rows=4))
    y.backward(CASE.dy[0].float() if y.shape[0] == T else torch.ones_like(y))
    return [y.detach()] + [args[n].grad if args[n].is_leaf else None for n in NAMES if n != "topk_ids"]


STRIDED = [
    ("x transposed", lambda a: a.update(x=a["x"].detach().t().contiguous().t().requires_grad_())),
    ("x every other row", lambda a: a.update(x=torch.stack([a["x"].detach(), a["x"].detach()], 1)[:, 0]
                                             .requires_grad_())),
    ("ids every other column", lambda a: a.update(topk_ids=torch.stack([a["topk_ids"], a["topk_ids"]], 2)[..., 1])),
    ("ids transposed", lambda a: a.update(topk_ids=a["topk_ids"].t().contiguous().t())),
    ("weights expanded", lambda a: a.update(topk_weights=a["topk_weights"].detach()[:, :1].expand(T, K))),
    ("fc1 transposed", lambda a: a.update(fc1_weight=a["fc1_weight"].detach().transpose(1, 2).contiguous()
                                          .transpose(1, 2).requires_grad_())),
    ("fc2 sliced", lambda a: a.update(fc2_weight=torch.cat([a["fc2_weight"].detach()] * 2, 2)[:, :, :I]
                                      .requires_grad_())),
]


@pytest.mark.parametrize("label,change", STRIDED, ids=[c[0] for c in STRIDED])
def test_strided_tensors_give_the_contiguous_results(label, change):
    args = _leaf_args()
    change(args)
    assert not all(t.is_contiguous() for t in args.values())
    base = _leaf_args()
    if label == "weights expanded":  # the same values, contiguous, and no router-weight gradient on either
        base["topk_weights"] = args["topk_weights"].contiguous()
    got, want = _run(args), _run(base)
    for name, a, b in zip(("y", "dx", "dw", "d_fc1", "d_fc2"), got, want):
        if a is None and b is None:
            continue
        # The same numbers up to the summation order of a matmul on another memory layout.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{label}: {name}: {m}")


def test_no_tokens_gives_an_empty_output_and_zero_weight_gradients():
    args = _leaf_args()
    for n in ("x", "topk_ids", "topk_weights"):
        args[n] = args[n].detach()[:0]
        if n != "topk_ids":
            args[n].requires_grad_()
    y = mok_moe(**args, backend="reference")
    assert y.shape == (0, H)
    y.sum().backward()
    assert args["x"].grad.shape == (0, H) and torch.equal(args["fc1_weight"].grad,
                                                          torch.zeros_like(args["fc1_weight"]))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_router_weight_stays_in_its_token(value):
    """Not an error: the contract's arithmetic. The token whose router weight is NaN or inf gets a
    non-finite output; every other token the clean call's."""
    clean = mok_moe(**_args(), backend="reference")
    args = _args()
    args["topk_weights"][2, 1] = value
    y = mok_moe(**args, backend="reference")
    assert not torch.isfinite(y[2]).all()
    others = [t for t in range(T) if t != 2]
    assert torch.equal(y[others], clean[others])
    want = dense_moe(args["x"], args["topk_ids"], args["topk_weights"], CASE.fc1_all, CASE.fc2_all)
    torch.testing.assert_close(y[others], want[others])
