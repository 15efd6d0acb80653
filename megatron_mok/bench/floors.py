"""The floors (docs/design.md, "Floors"): the least time a layer pass can take on a GPU whose
GEMM rate, HBM bandwidth and NVLink bandwidth are known.

For one rank r of the EP group, with T_r tokens, S_r used routes of its tokens, R_r routes
computed on it (rows of its expert GEMMs), L local experts, H hidden, I expert FFN size and
e = 2 bytes an element (bf16):

* compute: 6 * R_r * H * I FLOP forward (fc1 is 2I x H, fc2 is H x I, 2 FLOP a multiply-add),
  twice that backward (data and weight gradients), at the dense GEMM rate;
* HBM: the expert weights read once (3 * H * I * e bytes per local expert; backward also
  writes their gradients) plus the activations that must pass through HBM in the MoK
  dataflow (terms listed in :func:`hbm_bytes`);
* NVLink: off-rank rows, one H-row each way per remote route: dispatch brings in the
  R_r - (own routes) rows rank r computes for others and combine sends them back, while the
  S_r - (own routes) rows of its own tokens go out and come back. Bytes per direction:
  (received_remote_r + sent_remote_r) * H * e, at the per-direction peer bandwidth.

The layer cannot finish before its slowest rank, so each floor is the maximum over ranks,
and the layer's floor is the largest of the three (a perfect overlap of all three).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Sequence

ELEM_BYTES = 2  # bf16


@dataclass(frozen=True)
class DeviceRates:
    """Rates the floors divide by. Re-measure and override them (``--gemm-tflops``,
    ``--hbm-gbps``, ``--peer-gbps``) on other machines.

    Attributes:
        gemm_tflops: dense bf16 GEMM rate, TFLOP/s (10^12 FLOP/s).
        hbm_gbps: HBM bandwidth, GB/s (10^9 B/s), bytes read plus bytes written.
        peer_gbps: NVLink bandwidth between two GPUs, GB/s, per direction.
        source: where the numbers come from.
    """

    gemm_tflops: float
    hbm_gbps: float
    peer_gbps: float
    source: str

    def __post_init__(self) -> None:
        for name in ("gemm_tflops", "hbm_gbps", "peer_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DeviceRates.{name}={value!r} must be positive")

    def to_json(self) -> Dict[str, object]:
        return asdict(self)


H200 = DeviceRates(
    gemm_tflops=792.0,
    hbm_gbps=4153.0,
    peer_gbps=370.0,
    source=("measured on an H200 (two-GPU host): bf16 GEMM 8192^3 792 TFLOP/s; HBM copy 4153 GB/s "
            "(read + write); peer copy kernel 368-373 GB/s (pull) per direction"),
)
"""The measured rates of the H200 machines this project runs on."""


def rates_with(base: DeviceRates, *, gemm_tflops=None, hbm_gbps=None, peer_gbps=None) -> DeviceRates:
    """``base`` with the given rates replaced (source then says they were given by hand)."""
    given = {k: v for k, v in (("gemm_tflops", gemm_tflops), ("hbm_gbps", hbm_gbps),
                               ("peer_gbps", peer_gbps)) if v is not None}
    if not given:
        return base
    note = ", ".join(f"{k}={v:g}" for k, v in given.items())
    return replace(base, **given, source=f"given on the command line ({note}); others: {base.source}")


def model_flops(tokens: int, topk: int, hidden: int, ffn_hidden: int) -> float:
    """6 * T * K * H * I: forward FLOP of the routed experts of T tokens (backward: twice)."""
    return 6.0 * tokens * topk * hidden * ffn_hidden


def tflops(flop: float, ms: float) -> float:
    """TFLOP/s of ``flop`` done in ``ms`` milliseconds."""
    return flop / (ms * 1e-3) / 1e12


def hbm_bytes(*, hidden: int, ffn_hidden: int, experts: int, tokens: int, sent: int,
              received: int, backward: bool, elem_bytes: int = ELEM_BYTES,
              main_grad: bool = False) -> Dict[str, float]:
    """Bytes one rank moves through HBM in a layer pass, term by term.

    Args:
        hidden: H; ffn_hidden: I; experts: L local experts.
        tokens: T_r; sent: S_r routes of its tokens; received: R_r rows it computes.
        backward: the backward pass instead of the forward.
        main_grad: (backward) the weight gradients accumulated into fp32 ``main_grad`` (read and
            written once) instead of written in bf16.

    Returns:
        {term: bytes}. Forward: weights read; x read; dispatched rows written and read;
        fc1 output written (saved for backward); SwiGLU output written and read; combine
        slots written and read; y written. Backward: weights read; weight gradients written;
        dy read; dy rows written and read; saved x rows and fc1 output read; fc1-output
        gradient written and read; dx slots written and read; dx written.
    """
    e, H, I, T, S, R = elem_bytes, hidden, ffn_hidden, tokens, sent, received
    weights = 3.0 * H * I * e * experts
    if not backward:
        return {
            "weights_read": weights,
            "x_read": T * H * e,
            "dispatched_rows": 2.0 * R * H * e,
            "fc1_out_saved": R * 2 * I * e,
            "swiglu_out": 2.0 * R * I * e,
            "combine_slots": 2.0 * S * H * e,
            "y_write": T * H * e,
        }
    grads = ({"main_grad_read": 2.0 * weights, "main_grad_write": 2.0 * weights} if main_grad
             else {"weight_grads_write": weights})
    return {
        "weights_read": weights,
        **grads,
        "dy_read": T * H * e,
        "dy_rows": 2.0 * R * H * e,
        "saved_read": R * H * e + R * 2 * I * e,
        "fc1_out_grad": 2.0 * R * 2 * I * e,
        "dx_slots": 2.0 * S * H * e,
        "dx_write": T * H * e,
    }


@dataclass(frozen=True)
class PassFloor:
    """The floors of one pass (forward or backward), each the maximum over ranks.

    Attributes:
        flops: FLOP of the busiest rank.
        hbm_bytes: bytes through HBM of the rank with the most, by term.
        nvlink_bytes: off-rank bytes per direction of the rank with the most (dispatch plus
            combine).
        dispatch_bytes: off-rank bytes of dispatch alone in the busier direction of the rank
            with the most (combine moves as many the other way).
        compute_ms, hbm_ms, nvlink_ms: those at the rates.
        floor_ms: the largest of the three; bound: which one it is.
    """

    flops: float
    hbm_bytes: Dict[str, float] = field(default_factory=dict)
    nvlink_bytes: float = 0.0
    dispatch_bytes: float = 0.0
    compute_ms: float = 0.0
    hbm_ms: float = 0.0
    nvlink_ms: float = 0.0
    floor_ms: float = 0.0
    bound: str = ""

    def to_json(self) -> Dict[str, object]:
        out = asdict(self)
        out["hbm_bytes_total"] = sum(self.hbm_bytes.values())
        return out


def layer_floors(*, hidden: int, ffn_hidden: int, experts_per_gpu: int, tokens: Sequence[int],
                 sent: Sequence[int], received: Sequence[int], received_remote: Sequence[int],
                 sent_remote: Sequence[int], rates: DeviceRates,
                 elem_bytes: int = ELEM_BYTES, main_grad: bool = False) -> Dict[str, PassFloor]:
    """Forward and backward floors of the layer on P ranks.

    Args:
        hidden: H; ffn_hidden: I; experts_per_gpu: L.
        tokens, sent, received, received_remote, sent_remote: per rank (length P): T_r, S_r,
            R_r, remote routes computed on r, routes of r's tokens computed elsewhere
            (:class:`megatron_mok.bench.routing.RouteCounts`).
        rates: the device's rates.
        main_grad: the backward's weight gradients go into fp32 ``main_grad`` (:func:`hbm_bytes`).

    Returns:
        {"forward": PassFloor, "backward": PassFloor}.
    """
    lengths = {len(tokens), len(sent), len(received), len(received_remote), len(sent_remote)}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"per-rank lists must all have the same non-zero length, got {sorted(lengths)}")
    out: Dict[str, PassFloor] = {}
    for name, mult, backward in (("forward", 1, False), ("backward", 2, True)):
        flops = max(mult * 6.0 * r * hidden * ffn_hidden for r in received)
        per_rank_hbm = [hbm_bytes(hidden=hidden, ffn_hidden=ffn_hidden, experts=experts_per_gpu,
                                  tokens=t, sent=s, received=r, backward=backward,
                                  elem_bytes=elem_bytes, main_grad=main_grad and backward)
                        for t, s, r in zip(tokens, sent, received)]
        worst_hbm = max(per_rank_hbm, key=lambda terms: sum(terms.values()))
        nvlink = max((rr + sr) * hidden * elem_bytes for rr, sr in zip(received_remote, sent_remote))
        dispatch = max(max(rr, sr) * hidden * elem_bytes for rr, sr in zip(received_remote, sent_remote))
        compute_ms = flops / (rates.gemm_tflops * 1e12) * 1e3
        hbm_ms = sum(worst_hbm.values()) / (rates.hbm_gbps * 1e9) * 1e3
        nvlink_ms = nvlink / (rates.peer_gbps * 1e9) * 1e3
        times = {"compute": compute_ms, "hbm": hbm_ms, "nvlink": nvlink_ms}
        bound = max(times, key=times.get)
        out[name] = PassFloor(flops=flops, hbm_bytes=worst_hbm, nvlink_bytes=float(nvlink),
                              dispatch_bytes=float(dispatch),
                              compute_ms=compute_ms, hbm_ms=hbm_ms, nvlink_ms=nvlink_ms,
                              floor_ms=times[bound], bound=bound)
    return out
