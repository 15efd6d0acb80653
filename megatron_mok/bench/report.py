"""Output of the benchmarks: the table on stdout, Markdown for docs/benchmarks.md, the JSON
file and the PNG bar chart (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence

BACKEND_COLORS = {
    "mok-megakernel": "#d62728",
    "mok-cuda": "#ff7f0e",
    "a2a-grouped-mm": "#1f77b4",
    "megatron-alltoall": "#2ca02c",
    "megatron-flex-deepep": "#9467bd",
    "megatron-flex-hybridep": "#8c564b",
    "reference": "#7f7f7f",
}
"""One fixed color per layer-benchmark backend, the same in every chart."""

DISPATCHER_COLORS = {
    "mok": "#d62728",
    "mok:megakernel": "#d62728",
    "mok:cuda": "#ff7f0e",
    "mok:reference": "#7f7f7f",
    "alltoall": "#2ca02c",
    "flex-deepep": "#9467bd",
    "flex-hybridep": "#8c564b",
    "allgather": "#bcbd22",
}
"""Colors of the end-to-end dispatchers, matching their layer-benchmark backends."""

_FALLBACK_COLORS = ("#17becf", "#e377c2", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5")


def color_of(name: str, order: Sequence[str]) -> str:
    """The color of backend or dispatcher ``name`` (fixed for known backends, else by position
    in ``order``)."""
    if name in BACKEND_COLORS:
        return BACKEND_COLORS[name]
    if name in DISPATCHER_COLORS:
        return DISPATCHER_COLORS[name]
    return _FALLBACK_COLORS[list(order).index(name) % len(_FALLBACK_COLORS)]


def write_json(doc: Dict[str, object], path: str) -> None:
    """Write ``doc`` as indented JSON (directories created as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")


def _fmt(value: Optional[float], digits: int = 2) -> str:
    """``value`` with ``digits`` decimals, or 3 significant digits when that would show less."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if value != 0 and abs(value) < 10 ** (1 - digits):
        return f"{value:.3g}"
    return f"{value:.{digits}f}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# ----------------------------------------------------------------------------------------------
# Layer benchmark.

LAYER_COLUMNS = ("backend", "fwd ms", "fwd TFLOP/s", "fwd/floor", "bwd ms", "bwd TFLOP/s",
                 "bwd/floor", "comm GB/s", "peak MiB", "act MiB", "act/need", "max rel err")
"""Columns of the layer table. Memory (GPU runs; "-" elsewhere): "peak MiB" = peak allocated
during one forward + backward over what was allocated before it, "act MiB" = the most of it held
at once besides the gradients the backward returns (the activation memory,
``layer.working_peak``), "act/need" = activation memory over the
routed-rows need (:func:`memory_line`); each the largest rank's."""


def _backend_label(result: Dict[str, object]) -> str:
    """The backend's name, with the expert module a Megatron backend ran (e.g.
    "megatron-alltoall [TEGroupedMLP]")."""
    module = result.get("expert_module")
    return f"{result['backend']} [{module}]" if module else str(result["backend"])


def _layer_row(result: Dict[str, object]) -> List[str]:
    if result["status"] != "ok":
        return [_backend_label(result), f"{result['status']}: {_first_line(result.get('reason', ''))}"]
    check = result.get("check") or {}
    errors = [e for e in (check.get("rel_errors") or {}).values() if e is not None]
    err = "oracle" if check.get("oracle") else (f"{max(errors):.1e}" if errors else "unchecked")
    comm = (result.get("comm_GBps") or {}).get("forward")
    return [_backend_label(result), _fmt(result["forward_ms"]), _fmt(result["forward_tflops"], 0),
            _fmt(result["forward_vs_floor"]), _fmt(result["backward_ms"]),
            _fmt(result["backward_tflops"], 0), _fmt(result["backward_vs_floor"]),
            _fmt(comm, 0), _fmt(result.get("peak_mib"), 0), _fmt(result.get("activation_mib"), 0),
            _fmt(result.get("activation_vs_need")), err]


def floors_line(run: Dict[str, object]) -> str:
    """One line naming each pass's floor and its three parts."""
    parts = []
    for name in ("forward", "backward"):
        f = run["floors"][name]
        parts.append(f"{name} floor {_fmt(f['floor_ms'])} ms ({f['bound']}-bound; compute "
                     f"{_fmt(f['compute_ms'])}, HBM {_fmt(f['hbm_ms'])}, NVLink {_fmt(f['nvlink_ms'])})")
    return "; ".join(parts)


def memory_line(run: Dict[str, object]) -> str:
    """One line naming the routed-rows need of a run: the rows the largest rank's experts
    compute times the training ring's bytes a row, in MiB; empty for a record without it."""
    need = run.get("routed_rows_need")
    if not need:
        return ""
    rows = max(need["rows_per_rank"]) if need["rows_per_rank"] else 0
    return (f"routed-rows need {_fmt(need['mib'], 0)} MiB ({rows} routed rows on the largest rank x "
            f"{need['bytes_per_row']} bytes: x, router weight, gate|up)")


def layer_table(run: Dict[str, object]) -> str:
    """Fixed-width text table of one run (one shape and expert count), floors underneath."""
    rows = [list(LAYER_COLUMNS)] + [_layer_row(r) for r in run["results"]]
    full = [r for r in rows if len(r) == len(LAYER_COLUMNS)]
    widths = [max(len(r[i]) for r in full) for i in range(len(LAYER_COLUMNS))]
    lines = [f"== {run['label']} | {run['case']['tokens_per_gpu']} tokens/GPU | "
             f"{run['case']['ep_size']} GPU(s) | routing {run['routing_label']}"]
    for r in rows:
        if len(r) == len(LAYER_COLUMNS):
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        else:
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
    lines.append(floors_line(run))
    if memory_line(run):
        lines.append(memory_line(run))
    return "\n".join(lines)


def layer_markdown(doc: Dict[str, object]) -> str:
    """Markdown tables of every run of a layer-benchmark JSON document."""
    out = [f"Measured {doc['date_utc']} on {doc['machine']['description']}.", "",
           f"Command: `{doc['command']}`", ""]
    for run in doc["runs"]:
        out.append(f"**{run['label']}**, {run['case']['tokens_per_gpu']} tokens/GPU, "
                   f"{run['case']['ep_size']} GPU(s), top-{run['case']['shape']['topk']}, "
                   f"H={run['case']['shape']['hidden']}, I={run['case']['shape']['ffn_hidden']}, "
                   f"{run['case']['num_experts']} experts, routing {run['routing_label']}.")
        out.append("")
        out.append("| " + " | ".join(LAYER_COLUMNS) + " |")
        out.append("|" + "---|" * len(LAYER_COLUMNS))
        for r in run["results"]:
            row = _layer_row(r)
            if len(row) < len(LAYER_COLUMNS):
                row = row + [""] * (len(LAYER_COLUMNS) - len(row))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        out.append(floors_line(run) + ".")
        if memory_line(run):
            out.append(memory_line(run) + ".")
        out.append("")
    return "\n".join(out)


def _grouped_bars(ax, groups: List[str], series: List[str], values: Dict[str, List[Optional[float]]],
                  order: Sequence[str], floors: Optional[List[Optional[float]]] = None, unit: str = "ms",
                  floor_label: str = "floor: max(compute, HBM, NVLink)") -> None:
    import numpy as np

    n = max(1, len(series))
    width = 0.8 / n
    xs = np.arange(len(groups))
    for k, name in enumerate(series):
        offsets = xs - 0.4 + width * (k + 0.5)
        heights = [v if v is not None else 0.0 for v in values[name]]
        bars = ax.bar(offsets, heights, width * 0.95, label=name, color=color_of(name, order))
        for bar, v in zip(bars, values[name]):
            label = "n/a" if v is None else _fmt(v, 1 if v < 100 else 0)
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, rotation=90 if n > 4 else 0,
                        xytext=(0, 2), textcoords="offset points")
    if floors is not None:
        labelled = False
        for i, f in enumerate(floors):
            if f is None:
                continue
            ax.hlines(f, xs[i] - 0.45, xs[i] + 0.45, colors="black", linestyles="--", linewidth=1.2,
                      label=None if labelled else floor_label)
            labelled = True
    ax.set_xticks(xs)
    ax.set_xticklabels(groups, fontsize=8)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def layer_chart(doc: Dict[str, object], path: str) -> None:
    """Grouped bar chart of a layer-benchmark document: one group per run (shape and expert
    count), one bar per backend, forward and backward side by side, floors dashed; when the
    activation memory was measured (GPU runs), a third panel with it (MiB, largest rank), the
    routed-rows need dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    order = [b for b in BACKEND_COLORS]
    ran = {r["backend"] for run in runs for r in run["results"] if r["status"] == "ok"}
    series = [b for b in order if b in ran] + sorted(ran - set(order))
    groups = [run["label"].replace(", ", "\n") for run in runs]

    def value(run, backend, key):
        match = [r for r in run["results"] if r["backend"] == backend and r["status"] == "ok"]
        return match[0].get(key) if match else None

    memory = any(value(run, b, "activation_mib") is not None for run in runs for b in series)
    panels = 3 if memory else 2
    width = max(8.0, 3.2 * len(runs) + 3.0) * panels / 2
    fig, axes = plt.subplots(1, panels, figsize=(width, 4.8), squeeze=False)
    for ax, name in zip(axes[0], ("forward", "backward")):
        values = {b: [value(run, b, f"{name}_ms") for run in runs] for b in series}
        floors = [run["floors"][name]["floor_ms"] for run in runs]
        _grouped_bars(ax, groups, series, values, order, floors)
        ax.set_title(f"{name}")
        ax.set_ylabel("latency (ms), median of the slowest rank")
    if memory:
        ax = axes[0][2]
        values = {b: [value(run, b, "activation_mib") for run in runs] for b in series}
        needs = [(run.get("routed_rows_need") or {}).get("mib") for run in runs]
        need_label = "routed-rows need: real routed rows x training-ring bytes a row"
        _grouped_bars(ax, groups, series, values, order, needs, floor_label=need_label)
        ax.set_title("activation memory, forward + backward")
        ax.set_ylabel("MiB, peak without the returned gradients (largest rank)")
        need_lines = [h for h, label in zip(*ax.get_legend_handles_labels()) if label == need_label]
        if need_lines:
            ax.legend(need_lines, ["routed-rows need"], fontsize=7, loc="upper left")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    first = runs[0]["case"] if runs else {"tokens_per_gpu": 0, "ep_size": 0}
    fig.suptitle(f"MoE layer: {first['tokens_per_gpu']} tokens/GPU, {first['ep_size']} x "
                 f"{doc['machine'].get('gpu') or 'CPU'}, routing {doc['settings']['routing_label']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# End-to-end comparison.

E2E_COLUMNS = ("dispatcher", "step ms", "tokens/s/GPU", "TFLOP/s/GPU", "peak GB (alloc/reserved)",
               "lm loss (last)", "iters")


def _peak_memory(run: Dict[str, object]) -> str:
    memory = run.get("memory")
    if not memory:
        return "-"
    return f"{memory['max_allocated_mb'] / 1024:.1f} / {memory['max_reserved_mb'] / 1024:.1f}"


def _e2e_row(run: Dict[str, object]) -> List[str]:
    if run["status"] != "ok":
        return [run["label"], f"{run['status']}: {_first_line(run.get('reason', ''))}"]
    return [run["label"], _fmt(run["step_ms"], 1), _fmt(run["tokens_per_s_per_gpu"], 0),
            _fmt(run.get("tflops_per_gpu"), 1), _peak_memory(run), _fmt(run.get("lm_loss_last"), 4),
            str(run["iterations_measured"])]


def e2e_table(doc: Dict[str, object]) -> str:
    """Fixed-width text table of an end-to-end document."""
    rows = [list(E2E_COLUMNS)] + [_e2e_row(r) for r in doc["runs"]]
    full = [r for r in rows if len(r) == len(E2E_COLUMNS)]
    widths = [max(len(r[i]) for r in full) for i in range(len(E2E_COLUMNS))]
    lines = []
    for r in rows:
        if len(r) == len(E2E_COLUMNS):
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        else:
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
    return "\n".join(lines)


def e2e_markdown(doc: Dict[str, object]) -> str:
    """Markdown table of an end-to-end document (peak memory: the largest "max allocated" and
    "max reserved" of Megatron's memory reports over the reporting ranks)."""
    out = [f"Measured {doc['date_utc']} on {doc['machine']['description']}.", "",
           f"Command: `{doc['command']}`", "",
           "| " + " | ".join(E2E_COLUMNS) + " |", "|" + "---|" * len(E2E_COLUMNS)]
    for run in doc["runs"]:
        row = _e2e_row(run)
        row = row + [""] * (len(E2E_COLUMNS) - len(row))
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    return "\n".join(out)


def e2e_chart(doc: Dict[str, object], path: str) -> None:
    """Chart of an end-to-end document: tokens/s per GPU, step time and peak memory per
    dispatcher (bars), and the LM-loss curves of all dispatchers overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    labels = [r["dispatcher"] for r in runs]
    group = [doc["settings"]["config_label"]]
    fig, axes = plt.subplots(2, 2, figsize=(max(9.0, 1.2 * len(runs) + 7.0), 8.0), squeeze=False)
    for ax, key, ylabel in ((axes[0][0], "tokens_per_s_per_gpu", "tokens/s per GPU"),
                            (axes[0][1], "step_ms", "step time (ms), median")):
        values = {r["dispatcher"]: [r[key] if r["status"] == "ok" else None] for r in runs}
        _grouped_bars(ax, group, labels, values, labels)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(",")[0])
    memory = {r["dispatcher"]: [(r.get("memory") or {}).get("max_allocated_mb", 0) / 1024 or None
                                if r["status"] == "ok" else None] for r in runs}
    _grouped_bars(axes[1][0], group, labels, memory, labels)
    axes[1][0].set_ylabel("GB, max allocated (largest rank)")
    axes[1][0].set_title("peak device memory")
    ax = axes[1][1]
    for r in runs:
        curve = r.get("loss_curve") or []
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=r["dispatcher"],
                    color=color_of(r["dispatcher"], labels), linewidth=1.4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("loss curves")
    ax.grid(alpha=0.3)
    if any(r.get("loss_curve") for r in runs):
        ax.legend(fontsize=8)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=8, frameon=False)
    fig.suptitle(f"End to end: {doc['settings']['config_label']}, {doc['settings']['nproc_per_node']} x "
                 f"{doc['machine'].get('gpu') or 'CPU'}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
