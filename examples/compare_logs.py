"""Put two Megatron training logs side by side: first/last LM loss, tokens/s, and whether the
loss curves agree within bf16 noise.

    python examples/compare_logs.py RUN_A.log RUN_B.log --tokens-per-iteration 8192
"""

import argparse
import sys

from megatron_mok.megatron.training_log import compare_curves, compare_losses, losses, parse_log, summarize_run

# Two bf16 runs of the same model, data and initialisation whose MoE layers sum in different
# orders drift apart by round-off (megatron_mok.megatron.training_log.CurveComparison says how
# the verdict copes with that); beyond these bounds they compute different things.
EARLY_MAX_RELATIVE = 0.03   # first 10 iterations, point by point
WINDOW_MAX_SHIFT = 0.02     # means over windows of 10 iterations, relative to the first loss


def main(argv=None) -> int:
    """Print both summaries and the verdict; 0 if the curves agree, 2 if not, 1 on a bad log."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs=2, help="two Megatron logs (e.g. alltoall.log mok.log)")
    parser.add_argument("--tokens-per-iteration", type=int, required=True,
                        help="global batch size x sequence length")
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of the timing")
    args = parser.parse_args(argv)

    runs = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            curve = losses(parse_log(f.read())[1])
        if not curve:
            print(f"{path}: no iteration with an lm loss; see the log for the error", file=sys.stderr)
            return 1
        runs.append(curve)
        s = summarize_run(curve, args.tokens_per_iteration, args.warmup)
        print(f"{path}: {s.iterations} iterations, lm loss first {s.first_loss:.4f} last {s.last_loss:.4f}, "
              f"median {s.median_ms:.1f} ms/iteration, {s.tokens_per_s:,.0f} tokens/s")
    count, worst, mean = compare_losses(runs[0], runs[1])
    curves = compare_curves(runs[0], runs[1])
    agree = curves.agree(EARLY_MAX_RELATIVE, WINDOW_MAX_SHIFT)
    print(f"loss curves over {count} common iterations: per iteration max relative difference {worst:.2%}, "
          f"mean {mean:.2%}; first {curves.early_iterations} iterations max {curves.early_max_relative:.2%} "
          f"(bound {EARLY_MAX_RELATIVE:.0%}); {curves.windows} windows of 10, max mean shift "
          f"{curves.window_max_shift:.2%} of the first loss (bound {WINDOW_MAX_SHIFT:.0%}) -> "
          f"{'AGREE' if agree else 'DIFFER'}")
    return 0 if agree else 2


if __name__ == "__main__":
    sys.exit(main())
