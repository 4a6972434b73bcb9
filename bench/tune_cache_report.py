"""What the tuning cache says about candidate lists: per kernel family, how many candidates were timed,
at which position of the list the winner stood, and what keeping only the first k candidates would
have cost (the winner's time against the best of the first k). The data for trimming candidate lists,
which is most of a cold compile (each candidate is built, then timed).

    python bench/tune_cache_report.py [CACHE_DIR] [--show SUBSTRING]
        CACHE_DIR: default FUSEGRAPH_CACHE_DIR's tune/ folder; --show: also every timed candidate
        (config and ms) of the kernel families whose name contains SUBSTRING

Reads the JSON entries (tune/cache.py's format); writes nothing.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def family(name: str) -> str:
    """A kernel name without its plan-specific number: fg_k57_matmul -> matmul."""
    return re.sub(r"^fg_k\d+_", "", name)


def main() -> int:
    argv = sys.argv[1:]
    show = ""
    if "--show" in argv:
        at = argv.index("--show")
        show = argv[at + 1]
        del argv[at:at + 2]
    if argv:
        directory = Path(argv[0])
    else:
        from fusegraph.tune.cache import default_directory
        directory = default_directory()
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(directory.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            key = entry["key"]
            name = key.get("name") if isinstance(key, dict) else None
            times = [t.get("ms") for t in entry.get("timings", [])]
            configs = [t.get("config") for t in entry.get("timings", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        ok = [(i, ms) for i, ms in enumerate(times) if ms is not None]
        if len(ok) < 2:
            continue
        best_i, best = min(ok, key=lambda p: p[1])
        rows[family(str(name))].append({"n": len(times), "winner": best_i, "best": best, "times": times,
                                        "tuning_s": entry.get("tuning_s", 0.0), "configs": configs})
    print(f"tuning cache {directory}: {sum(len(v) for v in rows.values())} entries with >= 2 timed candidates")
    print(f"{'family':40s} {'entries':>7s} {'cands':>6s} {'tune s':>7s}  winner position histogram   "
          "loss keeping first k (geomean, worst) k=1 / 2 / 4")
    for fam, entries in sorted(rows.items(), key=lambda kv: -sum(e["tuning_s"] for e in kv[1])):
        hist: dict[int, int] = defaultdict(int)
        for e in entries:
            hist[e["winner"]] += 1
        losses = []
        for k in (1, 2, 4):
            ratios = []
            for e in entries:
                first = [ms for ms in e["times"][:k] if ms is not None]
                ratios.append(min(first) / e["best"] if first else float("inf"))
            finite = [r for r in ratios if r != float("inf")]
            geo = 1.0
            for r in finite:
                geo *= r
            geo = geo ** (1 / len(finite)) if finite else float("nan")
            losses.append(f"{geo:.3f},{max(ratios):.2f}")
        h = " ".join(f"{i}:{c}" for i, c in sorted(hist.items()))
        cands = sum(e["n"] for e in entries) / len(entries)
        tune_s = sum(e["tuning_s"] for e in entries)
        print(f"{fam[:40]:40s} {len(entries):7d} {cands:6.1f} {tune_s:7.1f}  {h:26s} {' / '.join(losses)}")
    for fam, entries in sorted(rows.items()):
        if show and show in fam:
            for e in entries:
                print(f"\n{fam}: {e['n']} candidates, winner {e['winner']}")
                for config, ms in zip(e["configs"], e["times"], strict=True):
                    print(f"   {'-' if ms is None else f'{ms:.4f}':>8s} ms  {config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
