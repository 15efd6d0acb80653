"""``@FILE`` arguments of the launcher, and the ``#@ key=value`` metadata of config files.

The model configs of ``configs/`` are files of Megatron flags; ``@FILE`` on the launcher's
command line stands for the flags in FILE, so configs compose with extra flags:
``mok-pretrain-gpt @configs/tiny.args --moe-token-dispatcher-type mok --train-iters 20``.
Launch scripts read a config's ``#@`` lines (comments to Megatron) to size a job. Nothing here
imports Megatron.
"""

from __future__ import annotations

import os
import shlex
from typing import List, Sequence

__all__ = ["expand_arg_files", "read_config_metadata"]


def expand_arg_files(argv: Sequence[str]) -> List[str]:
    """Replace every ``@FILE`` argument by the flags written in FILE.

    FILE holds flags as on a command line, any number per line; ``#`` starts a comment; quoting
    follows the shell. Files may include other files with ``@OTHER`` (relative paths are taken
    from the including file's directory).

    Args:
        argv: command-line arguments (without the program name).

    Returns:
        The arguments with every ``@FILE`` expanded in place.
    """
    out: List[str] = []
    for arg in argv:
        if not arg.startswith("@") or len(arg) == 1:
            out.append(arg)
            continue
        path = arg[1:]
        with open(path) as f:
            words = shlex.split(f.read(), comments=True)
        base = os.path.dirname(os.path.abspath(path))
        words = [("@" + os.path.join(base, w[1:])) if w.startswith("@") and not os.path.isabs(w[1:]) else w
                 for w in words]
        out.extend(expand_arg_files(words))
    return out


def read_config_metadata(path: str) -> dict:
    """The ``#@ key=value`` lines of a config file (e.g. ``nodes``, ``gpus_per_node``,
    ``experts_per_gpu``, ``min_gpus``), values as int where they are integers.

    Megatron ignores these lines (they are comments); launch scripts read them to size a job.
    """
    meta = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#@"):
                continue
            for item in line[2:].split():
                key, _, value = item.partition("=")
                meta[key] = int(value) if value.isdigit() else value
    return meta
