"""MoE layer shapes of public models, and the benchmark case built from one.

The sizes are those of the routed experts in each model's published configuration
(``hidden_size``, ``moe_intermediate_size``, number of routed experts, experts per token).
Shared experts, attention and the router are not part of the layer benchmark.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional


class ShapeError(ValueError):
    """A benchmark shape or case has sizes that cannot be run; the message says which."""


@dataclass(frozen=True)
class MoEShapeSpec:
    """Routed-expert sizes of a model.

    Attributes:
        name: display name, e.g. "Kimi-K2".
        hidden: H, the model hidden size.
        ffn_hidden: I, the expert FFN size (fc1 produces 2I columns: gate then up).
        num_experts: E, routed experts of the model.
        topk: K, experts per token.
    """

    name: str
    hidden: int
    ffn_hidden: int
    num_experts: int
    topk: int

    def to_json(self) -> Dict[str, object]:
        return asdict(self)


SHAPES: Dict[str, MoEShapeSpec] = {
    "kimi-k2": MoEShapeSpec("Kimi-K2", hidden=7168, ffn_hidden=2048, num_experts=384, topk=8),
    "deepseek-v3": MoEShapeSpec("DeepSeek-V3", hidden=7168, ffn_hidden=2048, num_experts=256, topk=8),
    "qwen3-235b": MoEShapeSpec("Qwen3-235B", hidden=4096, ffn_hidden=1536, num_experts=128, topk=8),
    "qwen3-30b-a3b": MoEShapeSpec("Qwen3-30B-A3B", hidden=2048, ffn_hidden=768, num_experts=128, topk=8),
    "glm-4.5": MoEShapeSpec("GLM-4.5", hidden=5120, ffn_hidden=1536, num_experts=160, topk=8),
}
"""Named shapes; keys are what ``--shape`` takes (case-insensitive)."""

CUSTOM = "custom"


def resolve_shape(
    name: str,
    *,
    hidden: Optional[int] = None,
    ffn_hidden: Optional[int] = None,
    num_experts: Optional[int] = None,
    topk: Optional[int] = None,
) -> MoEShapeSpec:
    """The shape called ``name`` (a key of :data:`SHAPES`, or "custom").

    For "custom", all four sizes must be given; for a named shape, any size given overrides
    the model's (the name then gets a "*" to show it was changed).

    Raises:
        ShapeError: for an unknown name, a missing custom size or a non-positive size.
    """
    key = name.strip().lower()
    overrides = {"hidden": hidden, "ffn_hidden": ffn_hidden, "num_experts": num_experts, "topk": topk}
    if key == CUSTOM:
        missing = [f"--{k.replace('_', '-')}" for k, v in overrides.items() if v is None]
        if missing:
            raise ShapeError(f"--shape custom needs {', '.join(missing)}")
        spec = MoEShapeSpec("custom", **overrides)  # type: ignore[arg-type]
    elif key in SHAPES:
        base = SHAPES[key]
        given = {k: v for k, v in overrides.items() if v is not None}
        spec = base if not given else MoEShapeSpec(**{**asdict(base), **given, "name": base.name + "*"})
    else:
        raise ShapeError(
            f"unknown shape {name!r}; supported: {', '.join(SHAPES)} or {CUSTOM} "
            "(with --hidden, --ffn-hidden, --num-experts, --topk)"
        )
    for field in ("hidden", "ffn_hidden", "num_experts", "topk"):
        value = getattr(spec, field)
        if not isinstance(value, int) or value < 1:
            raise ShapeError(f"{field}={value!r} for shape {spec.name} must be a positive integer")
    return spec


@dataclass(frozen=True)
class BenchCase:
    """One configuration of the layer benchmark, as run on an EP group of ``ep_size`` ranks.

    Attributes:
        shape: the model's routed-expert sizes.
        ep_size: P, ranks (GPUs) of the expert-parallel group.
        experts_per_gpu: L, experts held by each rank. Equal to E / P for the model's full
            expert count; smaller to reproduce on P GPUs the per-GPU load of a larger EP
            deployment (L = 6 is Kimi-K2 at EP = 64). The benchmark then has L * P experts.
        tokens_per_gpu: T, tokens of each rank.
    """

    shape: MoEShapeSpec
    ep_size: int
    experts_per_gpu: int
    tokens_per_gpu: int

    @property
    def num_experts(self) -> int:
        """Experts that exist in the benchmark: L * P."""
        return self.experts_per_gpu * self.ep_size

    @property
    def full(self) -> bool:
        """True when every expert of the model exists (L * P == E)."""
        return self.num_experts == self.shape.num_experts

    @property
    def label(self) -> str:
        """Short label for tables and chart groups, e.g. "Kimi-K2, 192 exp/GPU"."""
        return f"{self.shape.name}, {self.experts_per_gpu} exp/GPU"

    def to_json(self) -> Dict[str, object]:
        return {
            "shape": self.shape.to_json(),
            "ep_size": self.ep_size,
            "experts_per_gpu": self.experts_per_gpu,
            "num_experts": self.num_experts,
            "tokens_per_gpu": self.tokens_per_gpu,
        }


def make_case(shape: MoEShapeSpec, ep_size: int, tokens_per_gpu: int,
              experts_per_gpu: Optional[int] = None) -> BenchCase:
    """Build and check a :class:`BenchCase`.

    Args:
        shape: the model's sizes.
        ep_size: P >= 1.
        tokens_per_gpu: T >= 1.
        experts_per_gpu: L, or None for the model's full count E / P.

    Raises:
        ShapeError: when E is not divisible by P (full count), when L * P < K (top-k routing
            picks K distinct experts), or when a size is not positive.
    """
    if ep_size < 1:
        raise ShapeError(f"EP size {ep_size} must be at least 1")
    if tokens_per_gpu < 1:
        raise ShapeError(f"--tokens {tokens_per_gpu} must be at least 1")
    if experts_per_gpu is None:
        if shape.num_experts % ep_size:
            raise ShapeError(
                f"{shape.name} has {shape.num_experts} experts, not divisible by {ep_size} GPUs; "
                "pass --experts-per-gpu to choose the per-GPU count"
            )
        experts_per_gpu = shape.num_experts // ep_size
    if experts_per_gpu < 1:
        raise ShapeError(f"--experts-per-gpu {experts_per_gpu} must be at least 1")
    if experts_per_gpu * ep_size < shape.topk:
        raise ShapeError(
            f"--experts-per-gpu {experts_per_gpu} on {ep_size} GPU(s) gives "
            f"{experts_per_gpu * ep_size} experts, fewer than top-k={shape.topk}; each token picks "
            f"{shape.topk} distinct experts, so at least {-(-shape.topk // ep_size)} experts per GPU "
            "are needed here"
        )
    return BenchCase(shape=shape, ep_size=ep_size, experts_per_gpu=experts_per_gpu,
                     tokens_per_gpu=tokens_per_gpu)
