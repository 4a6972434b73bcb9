"""Where a bench's report goes: $OUT (the GPU machine's results folder) when it is set."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence


def write_report(prefix: str, lines: Sequence[str]) -> str | None:
    """Write `lines` to $OUT/<prefix>_<YYYYmmdd_HHMM>.txt; the path, or None when OUT is not set."""
    out = os.environ.get("OUT")
    if not out:
        return None
    stamp = time.strftime('%Y%m%d_%H%M')
    path = os.path.join(out, f"{prefix}_{stamp}.txt")
    n = 2
    while os.path.exists(path):   # a second run in the same minute keeps the first's report
        path = os.path.join(out, f"{prefix}_{stamp}_{n}.txt")
        n += 1
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
