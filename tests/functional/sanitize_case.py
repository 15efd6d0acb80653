"""A small standalone driver for ``compute-sanitizer --tool memcheck`` (not collected by pytest):
one P = 1 call of each GPU backend, forward and backward, on small shapes, checked against the
fp32 oracle; with ``--faults`` also a bad expert id at P = 1 (NaN, then the documented error).
``--virtual`` adds the same on two virtual ranks and the fault paths between them (a bad id on
one rank; a rank that stops a call before queueing it, so that its peer stops at its failure
word): only without the sanitizer, since memcheck runs one kernel at a time and virtual ranks'
kernels wait on each other.

Run from the repository root, on one sm_90 GPU:

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m tests.functional.sanitize_case --faults

It exits 0 when every call gave the oracle's result (or the documented error), 1 otherwise.
Timeouts are long (kernels run many times slower under the sanitizer), so nothing here waits for
one.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # virtual ranks spin-wait on each other

import torch  # noqa: E402

from megatron_mok import MoKConfig  # noqa: E402
from megatron_mok.functional import (LocalEPGroup, MoKCapacityError, MoKPeerError, MoKRuntimeError,  # noqa: E402
                                     check_errors, mok_moe)
from megatron_mok.functional.workspace import release_workspaces  # noqa: E402

from tests.gpu_cases import check_against_oracle, gpu_case, leaves, run_case  # noqa: E402

H, I, L, K = 512, 256, 2, 2
TIMEOUT_S = 120.0


def _clean_calls(backend: str, virtual: bool) -> None:
    case = gpu_case(301, [96], H, I, L, K)
    check_against_oracle(case, run_case(case, [None], MoKConfig(timeout_s=TIMEOUT_S), backend),
                         f"{backend} P=1")
    print(f"{backend}: P=1 forward + backward match the oracle", flush=True)
    if not virtual:
        return
    group = LocalEPGroup(2)
    case = gpu_case(302, [96, 70], H, I, L, K)
    config = MoKConfig(max_tokens_per_rank=96, timeout_s=TIMEOUT_S)
    check_against_oracle(case, run_case(case, group.ranks, config, backend, group.streams), f"{backend} virtual P=2")
    print(f"{backend}: virtual P=2 forward + backward match the oracle", flush=True)


def _expect(error_type, fn, what: str) -> None:
    try:
        fn()
    except error_type as err:
        print(f"  {what}: {type(err).__name__}: {str(err)[:160]}", flush=True)
        return
    raise AssertionError(f"{what}: expected {error_type.__name__}")


def _bad_id_p1(backend: str) -> None:
    case = gpu_case(305, [64], H, I, L, K)
    ids = case.ids[0].clone()
    ids[3, 0] = 1000
    x, w, fc1, fc2 = leaves(case, 0)
    y = mok_moe(x, ids, w, fc1, fc2, config=MoKConfig(timeout_s=TIMEOUT_S), backend=backend)
    torch.cuda.synchronize()
    assert torch.isnan(y.float()).all()
    _expect(MoKRuntimeError, check_errors, f"{backend} bad id at P=1")
    release_workspaces()


def _bad_id_on_one_rank(backend: str) -> None:
    group = LocalEPGroup(2)
    case = gpu_case(303, [64, 64], H, I, L, K)
    config = MoKConfig(max_tokens_per_rank=64, timeout_s=TIMEOUT_S)
    ys = []
    for r in range(2):  # a bad id on rank 1: NaN on both, the error naming rank 1
        ids = case.ids[r].clone()
        if r == 1:
            ids[3, 0] = 1000
        group.streams[r].wait_stream(torch.cuda.current_stream())
        x, w, fc1, fc2 = leaves(case, r)
        with torch.cuda.stream(group.streams[r]):
            ys.append(mok_moe(x, ids, w, fc1, fc2, ep_group=group[r], config=config, backend=backend))
    torch.cuda.synchronize()
    assert all(torch.isnan(y.float()).all() for y in ys)
    _expect(MoKRuntimeError, lambda: check_errors(group[0]), f"{backend} bad id")


def _one_rank_stops(backend: str) -> None:
    config = MoKConfig(max_tokens_per_rank=64, timeout_s=TIMEOUT_S)
    group = LocalEPGroup(2)
    big = gpu_case(304, [64, 80], H, I, L, K)
    group.streams[0].wait_stream(torch.cuda.current_stream())
    group.streams[1].wait_stream(torch.cuda.current_stream())
    x, w, fc1, fc2 = leaves(big, 0)
    with torch.cuda.stream(group.streams[0]):
        y0 = mok_moe(x, big.ids[0], w, fc1, fc2, ep_group=group[0], config=config, backend=backend)
    x, w, fc1, fc2 = leaves(big, 1)
    with torch.cuda.stream(group.streams[1]):
        _expect(MoKCapacityError, lambda: mok_moe(x, big.ids[1], w, fc1, fc2, ep_group=group[1], config=config,
                                                  backend=backend), f"{backend} capacity on rank 1")
    torch.cuda.synchronize()
    assert torch.isnan(y0.float()).all()
    _expect(MoKPeerError, lambda: check_errors(group[0]), f"{backend} rank 0 after rank 1 stopped")


def _fault_calls(backend: str, virtual: bool) -> None:
    _bad_id_p1(backend)
    gc.collect()
    if virtual:
        _bad_id_on_one_rank(backend)
        gc.collect()  # the failed groups (and their workspaces) go before the next
        _one_rank_stops(backend)
        gc.collect()
    print(f"{backend}: the fault paths end in the documented errors", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "megakernel", "both"), default="both")
    parser.add_argument("--faults", action="store_true", help="also run the fault paths")
    parser.add_argument("--virtual", action="store_true",
                        help="also two virtual ranks (not under compute-sanitizer: it runs one kernel at a time)")
    args = parser.parse_args(argv)
    backends = ("cuda", "megakernel") if args.backend == "both" else (args.backend,)
    for backend in backends:
        _clean_calls(backend, args.virtual)
        if args.faults:
            _fault_calls(backend, args.virtual)
        release_workspaces()
        gc.collect()  # the released workspaces (reference cycles) go before the next backend's calls
    torch.cuda.synchronize()
    print("sanitize_case: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
