"""Shared piece of the C ABI tests: the field names of a ``typedef struct ... { ... } Name;`` in
a header of csrc/include/mok/ (the library fixtures ``lib`` and ``use_lib`` are in conftest.py)."""

from __future__ import annotations

import re
from typing import List

from megatron_mok import _build


def struct_fields(header: str, struct: str) -> List[str]:
    """Field names, in order, of ``typedef struct <struct> { ... } <struct>;`` in
    csrc/include/mok/<header> (comments dropped; ``a, b`` declarations give both names)."""
    text = (_build.CSRC_DIR / "include" / "mok" / header).read_text()
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            first, *rest = decl.split(",")
            names += [first.split()[-1].lstrip("*")] + [r.strip() for r in rest]
    return names
