"""MoKConfig: the tunables of the MoK MoE layer, their validation and their default heuristic.

Every field may be left as ``None``; :meth:`MoKConfig.resolve` fills those from the layer's
shape and the device (see ``docs/architecture.md``, "Choosing the tunables"). Validation runs
in ``__post_init__`` and again after resolution, so a bad value fails where it is written,
with a message naming the field, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

# Tile heights the GPU kernels are written for (rows of one wgmma row block). The reference
# backend takes any power of two up to 256 (small tiles keep CPU tests small).
GPU_TILE_ROWS = (64, 128)
MAX_TILE_ROWS = 256
# GEMM tile used by the heuristic: 128 rows x 256 output columns per compute SM and tile.
HEURISTIC_TILE_COLS = 256
# Comm SMs of the megakernel's forward. They pull the first row blocks of every launch (fc2's
# epilogue pushes the output rows home, the compute CTAs' idle warps pull the rest) and, with
# grad, write every pulled row twice (the ring and the training copy). Measured with grad on two
# H200s (docs/perf-notes.md): 8 beat 6 by 0.067 ms at 6 experts per GPU; at 192, 6 beat 4 by
# 0.51 ms. The backward's count (no backend reads it yet) is 10.
COMM_SMS_DEFAULT = 8
COMM_SMS_BACKWARD = 10
# Mean routed rows per local expert at or below which the forward is bound by reading expert
# weights (Kimi-K2 and DeepSeek-V3 at EP 2: ~170 and 256 rows per expert): a tile waits on HBM,
# so the pulls have more time per row and fewer comm SMs keep ahead.
WEIGHT_BOUND_ROWS_PER_EXPERT = 256
COMM_SMS_WEIGHT_BOUND = 6
# A forward without grad saves no activations for the backward: its pulls write each row once
# instead of twice, and two comm SMs fewer keep up (4 at 192 per GPU, where 2 were 1.36 ms
# slower; 6 at 6 per GPU, level with 4).
COMM_SMS_FEWER_WITHOUT_GRAD = 2
H200_NUM_SMS = 132
MAX_TOKENS_PER_RANK = 2 ** 31 - 1
# The training ring's default: the rows a rank receives with uniform routing (T x K), times this
# margin, plus half a tile of padding per local expert (the mean), and never less than the most
# one rank's own tokens can fill (T x K + L x (tile - 1)), so P = 1 never replays. Routing that
# sends more rows to a rank replays the excess in the backward (time, never memory).
TRAINING_RING_MARGIN = 1.25
# The backward (and the cuda backend's forward) walks the layout in chunks of the training ring's
# rows, but never fewer than this many: the GEMMs of a smaller chunk fill the device poorly.
MIN_TRAINING_CHUNK_ROWS = 4096


class MoKConfigError(ValueError):
    """A MoK tunable has a value outside what is supported."""


@dataclass(frozen=True)
class MegakernelTunables:
    """Launch-shape tunables of the forward megakernel (C: ``MokMegakernelTunables``,
    csrc/include/mok/megakernel.h). ``None`` takes the library's default
    (``megatron_mok.ops.megakernel.default_tunables()``), so Python mirrors no default. Results
    never depend on these: every setting gives bitwise the same output."""

    pairs: Optional[bool] = None
    """Run the launch in clusters of two CTAs that take pairs of row blocks and share each weight
    tile (docs/megakernel.md, "Pair mode"). Default on: faster at every measured expert load. The
    launch runs single CTAs whenever the grid or the comm-SM count is odd."""

    group_blocks: Optional[int] = None
    """Row blocks of a group: the tiles of one column sweep inside a minibatch, whose CTAs share
    the weight tile in L2. Even, from 2 to 64 (the library's limits). Default 8: 16 measured
    faster at 48 experts per GPU and slower at 6 and 192 (docs/perf-notes.md)."""

    def __post_init__(self) -> None:
        if self.pairs is not None and not isinstance(self.pairs, bool):
            raise MoKConfigError(
                f"MegakernelTunables.pairs={self.pairs!r} must be None (the library's default: on), "
                "True or False")
        g = self.group_blocks
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2):
            raise MoKConfigError(
                f"MegakernelTunables.group_blocks={g!r} must be None (the library's default) or an "
                "even integer >= 2 (the library's upper limit is checked when the megakernel "
                "resolves it)")


@dataclass(frozen=True)
class MoKConfig:
    """Tunables of the MoK dispatch + expert FFN + combine.

    All sizes are in token rows. ``None`` means "choose from the shape and the device"
    (:meth:`resolve`). Results never depend on these values: every setting gives bitwise the
    same output.
    """

    comm_sms_forward: Optional[int] = None
    """SMs of the persistent forward kernel that only move data: they pull dispatch rows (the
    compute SMs push the combine rows from fc2's epilogue). At least 2 and fewer than the
    device's SM count."""

    comm_sms_backward: Optional[int] = None
    """Same as ``comm_sms_forward``, for the backward kernels. Checked like it, but no backend
    reads it yet: every backward runs the ``cuda`` backend's kernels, which size their own
    grids."""

    minibatch_rows: Optional[int] = None
    """Rows handed to the expert GEMMs at once: the overlap granularity. A positive multiple of
    ``tile_rows``; the default gives every compute SM at least two waves of GEMM tiles."""

    ring_rows: Optional[int] = None
    """Rows of the fixed-size ring token buffer (the macrobatch) that holds received tokens.
    A multiple of ``minibatch_rows`` and at least two minibatches, so one fills while the
    other is computed. Bounds the megakernel's memory whatever the routing."""

    tile_rows: int = 128
    """Height of a GEMM row block; each expert's segment of the schedule is padded to it.
    A power of two up to 256; the GPU backends take 64 or 128."""

    timeout_s: float = 60.0
    """Seconds a rank waits for a peer (barrier, flag, ring slot) before it reports an error
    naming the peer and the place. Positive. Every backend honours it: the GPU backends' waits on
    the device, and on the host the reference backend's rendezvous at each cross-rank step and
    every backend's settings exchange and workspace creation (docs/contract.md, "Errors")."""

    max_tokens_per_rank: Optional[int] = None
    """Capacity of the communication workspace in tokens per rank. ``None``: agreed by all
    ranks at the first call (the largest token count of any rank). A later call with more
    tokens raises an error instead of reallocating, since reallocation is collective."""

    num_experts: Optional[int] = None
    """Total expert count E, if the caller wants it checked against the weights
    (E must be divisible by the EP size and E / P must equal ``fc1_weight.shape[0]``)."""

    megakernel: MegakernelTunables = MegakernelTunables()
    """The forward megakernel's launch-shape tunables (pair mode, group size)."""

    training_ring_rows: Optional[int] = None
    """Rows of the expert-grouped layout whose activations a forward with grad keeps for the
    backward (x, the router weight and the fc1 pre-activation gate | up: 2H + 4 + 4I bytes a
    row). Rows past it are replayed by the backward (their x pulled again, fc1 recomputed,
    bitwise the forward's), so a hot expert costs time, never memory. A multiple of
    ``tile_rows``; 0 replays every row. Default :func:`default_training_ring_rows`. Results never
    depend on it."""

    def __post_init__(self) -> None:
        _check_optional_int(self, "comm_sms_forward", minimum=2)
        _check_optional_int(self, "comm_sms_backward", minimum=2)
        _check_optional_int(self, "minibatch_rows", minimum=1)
        _check_optional_int(self, "ring_rows", minimum=1)
        _check_optional_int(self, "max_tokens_per_rank", minimum=1)
        _check_optional_int(self, "training_ring_rows", minimum=0)
        if self.training_ring_rows is not None and self.training_ring_rows % self.tile_rows:
            raise MoKConfigError(
                f"MoKConfig.training_ring_rows={self.training_ring_rows} must be a multiple of "
                f"tile_rows={self.tile_rows} (whole row blocks are kept or replayed)")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank > MAX_TOKENS_PER_RANK:
            raise MoKConfigError(
                f"MoKConfig.max_tokens_per_rank={self.max_tokens_per_rank} is above {MAX_TOKENS_PER_RANK}: the "
                "kernels count a rank's tokens in int32")
        _check_optional_int(self, "num_experts", minimum=1)
        if not isinstance(self.megakernel, MegakernelTunables):
            raise MoKConfigError(
                f"MoKConfig.megakernel={self.megakernel!r} must be a MegakernelTunables")
        t = self.tile_rows
        if isinstance(t, bool) or not isinstance(t, int) or t < 1 or t > MAX_TILE_ROWS or t & (t - 1):
            raise MoKConfigError(
                f"MoKConfig.tile_rows={t!r} is not supported; it must be a power of two "
                f"between 1 and {MAX_TILE_ROWS} (the GPU backends take {GPU_TILE_ROWS})"
            )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise MoKConfigError(
                f"MoKConfig.timeout_s={self.timeout_s!r} must be a positive finite number of seconds"
            )
        if self.minibatch_rows is not None and self.minibatch_rows % self.tile_rows:
            raise MoKConfigError(
                f"MoKConfig.minibatch_rows={self.minibatch_rows} must be a multiple of "
                f"tile_rows={self.tile_rows}"
            )
        if self.ring_rows is not None and self.minibatch_rows is not None:
            if self.ring_rows % self.minibatch_rows or self.ring_rows < 2 * self.minibatch_rows:
                raise MoKConfigError(
                    f"MoKConfig.ring_rows={self.ring_rows} must be a multiple of "
                    f"minibatch_rows={self.minibatch_rows} and at least two minibatches "
                    f"({2 * self.minibatch_rows})"
                )

    def check_device(self, num_sms: int) -> None:
        """Raise :class:`MoKConfigError` if the comm-SM counts do not fit a device of
        ``num_sms`` multiprocessors (at least one SM must remain for compute)."""
        for name in ("comm_sms_forward", "comm_sms_backward"):
            value = getattr(self, name)
            if value is not None and value >= num_sms:
                raise MoKConfigError(
                    f"MoKConfig.{name}={value} leaves no compute SM on a device with "
                    f"{num_sms} SMs; it must be between 2 and {num_sms - 1}"
                )

    def check_experts(self, ep_size: int, experts_per_rank: int) -> None:
        """Raise :class:`MoKConfigError` if ``num_experts`` (when set) does not split into
        ``ep_size`` ranks of ``experts_per_rank`` experts."""
        if self.num_experts is None:
            return
        if self.num_experts % ep_size:
            raise MoKConfigError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size "
                f"{ep_size}; MoK places E / P whole experts on every rank"
            )
        if self.num_experts // ep_size != experts_per_rank:
            raise MoKConfigError(
                f"num_experts={self.num_experts} over {ep_size} ranks gives "
                f"{self.num_experts // ep_size} experts per rank, but the expert weights hold "
                f"{experts_per_rank} (fc1_weight.shape[0])"
            )

    def resolve(
        self,
        *,
        hidden: int,
        ffn_hidden: int,
        num_sms: int = H200_NUM_SMS,
        ep_size: int = 1,
        rows_per_expert: Optional[float] = None,
    ) -> "MoKConfig":
        """Return a copy with every ``None`` tunable chosen from the shape and the device.

        Heuristic (documented in docs/architecture.md):

        * comm SMs: the forward :data:`COMM_SMS_DEFAULT` (8), or :data:`COMM_SMS_WEIGHT_BOUND`
          (6) when ``rows_per_expert`` is at most :data:`WEIGHT_BOUND_ROWS_PER_EXPERT`; the
          backward :data:`COMM_SMS_BACKWARD` (10); at most a quarter of the SMs. The forward's
          comm SMs only pull (a comm SM moving rows with TMA bulk copies reads ~35 GB/s of
          rows, docs/perf-notes.md); in the weight-bound regime a tile waits on HBM, so fewer
          keep ahead of the GEMMs. The same rows move at P = 1 (local copies), so the default
          does not depend on P. This is the count of a forward that saves activations (grad
          on); one that saves none takes :data:`COMM_SMS_FEWER_WITHOUT_GRAD` fewer
          (:meth:`forward_comm_sms`).
        * ``megakernel`` stays as given: the megakernel backend fills its ``None`` fields from
          the library's defaults (``megakernel_backend.resolve_tunables``).
        * minibatch: the smallest multiple of ``tile_rows`` whose fc1 (N = 2 * ffn_hidden) and
          fc2 (N = hidden) tile grids, in tiles of ``tile_rows`` x 256, each give every compute
          SM at least two waves.
        * ring: four minibatches (two being computed or pushed while two fill).

        Args:
            hidden: H, the model hidden size.
            ffn_hidden: I, the expert FFN size (fc1 produces 2 * I columns).
            num_sms: multiprocessors of the device.
            ep_size: P, ranks of the expert-parallel group.
            rows_per_expert: mean routed rows per local expert of the calls (tokens x top-k /
                local experts), if known; picks the forward's comm-SM default.
        """
        self.check_device(num_sms)
        def default(count: int) -> int:
            return max(2, min(count, num_sms // 4))
        weight_bound = rows_per_expert is not None and rows_per_expert <= WEIGHT_BOUND_ROWS_PER_EXPERT
        default_fwd = default(COMM_SMS_WEIGHT_BOUND if weight_bound else COMM_SMS_DEFAULT)
        comm_fwd = self.comm_sms_forward if self.comm_sms_forward is not None else default_fwd
        comm_bwd = self.comm_sms_backward if self.comm_sms_backward is not None else default(COMM_SMS_BACKWARD)
        minibatch = self.minibatch_rows
        if minibatch is None:
            minibatch = default_minibatch_rows(
                hidden=hidden, ffn_hidden=ffn_hidden, compute_sms=num_sms - comm_fwd,
                tile_rows=self.tile_rows,
            )
        ring = self.ring_rows if self.ring_rows is not None else 4 * minibatch
        return dataclasses.replace(
            self,
            comm_sms_forward=comm_fwd,
            comm_sms_backward=comm_bwd,
            minibatch_rows=minibatch,
            ring_rows=ring,
        )

    def training_ring(self, *, tokens: int, topk: int, experts_per_rank: int) -> int:
        """Rows of the training ring for calls of ``tokens`` tokens, top-``topk``, on
        ``experts_per_rank`` local experts: ``training_ring_rows`` or its default."""
        if self.training_ring_rows is not None:
            return self.training_ring_rows
        return default_training_ring_rows(tokens=tokens, topk=topk, experts_per_rank=experts_per_rank,
                                          tile_rows=self.tile_rows)

    def forward_comm_sms(self, resolved: "MoKConfig", *, saves_activations: bool) -> int:
        """Comm SMs of one forward launch, ``self`` being the config as given and ``resolved``
        its :meth:`resolve`. A forward that saves activations for the backward takes
        ``resolved.comm_sms_forward``; one that saves none (no grad) takes the same when
        ``comm_sms_forward`` was given, else :data:`COMM_SMS_FEWER_WITHOUT_GRAD` fewer, at
        least 2. The minibatch and ring stay the resolved ones either way (one ring serves
        both kinds of call)."""
        comm = resolved.comm_sms_forward
        if comm is None:
            raise MoKConfigError("forward_comm_sms needs the resolved config (MoKConfig.resolve)")
        if saves_activations or self.comm_sms_forward is not None:
            return comm
        return max(2, comm - COMM_SMS_FEWER_WITHOUT_GRAD)


def default_minibatch_rows(*, hidden: int, ffn_hidden: int, compute_sms: int, tile_rows: int) -> int:
    """Smallest multiple of ``tile_rows`` giving ``compute_sms`` SMs two waves of GEMM tiles
    in both fc1 (N = 2 * ffn_hidden) and fc2 (N = hidden), with tiles of ``tile_rows`` x 256."""
    waves = 2
    min_rows = tile_rows
    for n_cols in (2 * ffn_hidden, hidden):
        col_tiles = max(1, -(-n_cols // HEURISTIC_TILE_COLS))
        row_tiles = -(-waves * compute_sms // col_tiles)
        min_rows = max(min_rows, row_tiles * tile_rows)
    return min_rows


def default_training_ring_rows(*, tokens: int, topk: int, experts_per_rank: int, tile_rows: int) -> int:
    """The training ring's default, rounded up to ``tile_rows``: max(ceil(T x K x
    :data:`TRAINING_RING_MARGIN`) + L x tile_rows / 2, T x K + L x (tile_rows - 1)). The first
    term is the rows one rank receives with uniform routing, a margin and the mean padding of a
    segment; the second the most a layout of one rank's own T x K routes can take (so P = 1
    never replays)."""
    rows = max(math.ceil(tokens * topk * TRAINING_RING_MARGIN) + experts_per_rank * tile_rows // 2,
               tokens * topk + experts_per_rank * (tile_rows - 1))
    return -(-rows // tile_rows) * tile_rows


def training_chunk_rows(ring_rows: int, tile_rows: int) -> int:
    """Rows of one chunk of the layout that the backward (and the cuda backend's forward) runs at
    once: the training ring's rows, at least :data:`MIN_TRAINING_CHUNK_ROWS`, a multiple of
    ``tile_rows``. Chunks never change results (the weight gradients carry their fp32 partial sum
    exactly from one chunk to the next)."""
    rows = max(ring_rows, MIN_TRAINING_CHUNK_ROWS)
    return -(-rows // tile_rows) * tile_rows


def training_ring_bytes(rows: int, hidden: int, ffn_hidden: int) -> int:
    """Bytes of a training ring of ``rows`` rows: x bf16 [rows, H], router weight fp32 [rows],
    gate | up bf16 [rows, 2I]."""
    return rows * (2 * hidden + 4 + 4 * ffn_hidden)


def _check_optional_int(cfg: MoKConfig, name: str, *, minimum: int) -> None:
    value = getattr(cfg, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MoKConfigError(
            f"MoKConfig.{name}={value!r} must be None (chosen automatically) or an integer "
            f">= {minimum}"
        )
