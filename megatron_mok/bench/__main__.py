"""``python -m megatron_mok.bench {layer,e2e,gemm,tune} ...`` (also the ``mok-bench`` command).

* ``layer``: one MoE layer, every available backend side by side (start with torchrun);
* ``e2e``: Megatron training steps with each token dispatcher (starts torchrun itself);
* ``gemm``: the grouped-GEMM kernels next to ``torch._grouped_mm`` (:mod:`megatron_mok.bench.gemm`);
* ``tune``: the megakernel's comm SMs, minibatch, ring, pair mode and group size for one shape,
  written as Megatron flags.

``layer`` and ``e2e`` write a table to stdout and NAME.json, NAME.png and NAME.md to ``--out``;
``gemm`` a table and, with ``--out``, one JSON line per result; ``tune`` an args file.

Performance experiments (A/B timings, kernel timelines, profiles) are not part of the package:
tools/perf/README.md.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "layer": ("megatron_mok.bench.layer", "time one MoE layer with every available backend (under torchrun)"),
    "e2e": ("megatron_mok.bench.e2e", "compare dispatchers in Megatron training steps (runs torchrun itself)"),
    "gemm": ("megatron_mok.bench.gemm", "benchmark the grouped GEMM kernels"),
    "tune": ("megatron_mok.bench.tune", "pick the megakernel's tunables for a shape, written as flags (under torchrun)"),
}


def usage() -> str:
    lines = ["usage: python -m megatron_mok.bench {" + ",".join(SUBCOMMANDS) + "} [options]", ""]
    lines += [f"  {name:6s} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'python -m megatron_mok.bench SUBCOMMAND --help' for its options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch to a subcommand's ``main(argv)``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\nerror: unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"error: the '{name}' benchmark needs {module_name}, which is not part of this "
              "installation (the layer and e2e benchmarks do not need it)",
              file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
