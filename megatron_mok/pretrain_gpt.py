"""Entry point of the launcher: ``python -m megatron_mok.pretrain_gpt [Megatron flags]`` and the
console script ``mok-pretrain-gpt``. The launcher is :mod:`megatron_mok.megatron.pretrain`;
this module only records when the program started (for Megatron's start-up timing log) and
calls it."""

import time

_PROGRAM_START = time.time()

import sys  # noqa: E402


def main(argv=None) -> int:
    """Run :func:`megatron_mok.megatron.pretrain.main` with ``argv`` (default ``sys.argv[1:]``);
    returns the process exit status."""
    from megatron_mok.megatron.pretrain import main as pretrain_main

    return pretrain_main(argv, program_start=_PROGRAM_START)


if __name__ == "__main__":
    sys.exit(main())
