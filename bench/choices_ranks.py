"""Which GEMM candidates earn their compiles? Reads a tuning-choices file written by
`warm_compile_gpu.py --choices` (every candidate's time and each GEMM's M N K), puts each GEMM's
timed candidates in the order codegen/gemm_configs gives them for that shape, and reports, per kind
(tiled, tiled TMA, persistent, split-K, cuBLAS) and position, how often it won; then, for pruned
candidate lists (the first few of each kind), how many compiles they would save and how much slower
the best kept candidate would be, summed over the file's GEMMs; and a two-phase rule (cuBLAS and the first
Triton candidate first, the rest only when that one comes within a gate of cuBLAS). No GPU needed.

    python bench/choices_ranks.py bench/results/choices_resnet50_<date>.txt [more files]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from typing import Any

from fusegraph.codegen.gemm_configs import GemmGeometry, gemm_candidates

HEADER = re.compile(r"^(\S+)\s+\[M N K = (\d+) (\d+) (\d+)\]\s+(\d+) candidates")
ROW = re.compile(r"^\s+(\S+)\s+(\{.*\})$")
# pruned lists: how many of each kind to keep, in gemm_configs' order (cuBLAS always kept)
POLICIES = {"all": (99, 99, 99, 99), "tiled 3, TMA 1, persistent 2": (3, 1, 2, 99),
            "tiled 2, TMA 1, persistent 1": (2, 1, 1, 99), "tiled 2, TMA 2, persistent 2": (2, 2, 2, 99),
            "tiled 3, TMA 0, persistent 2": (3, 0, 2, 99), "tiled 3, TMA 1, persistent 1": (3, 1, 1, 99),
            "tiled 3, TMA 0, persistent 1": (3, 0, 1, 99), "tiled 2, TMA 0, persistent 2": (2, 0, 2, 99)}


def kind(config: dict[str, Any]) -> str:
    if config.get("backend") == "cublas":
        return "cublas"
    variant = str(config.get("VARIANT", "tiled"))
    return f"{variant} TMA" if config.get("USE_TMA") and variant == "tiled" else variant


def read(path: str) -> list[tuple[tuple[int, int, int], list[tuple[float, dict[str, Any]]]]]:
    """(M, N, K) and the timed candidates (ms, config) of each fg_matmul block with its shape."""
    out: list[tuple[tuple[int, int, int], list[tuple[float, dict[str, Any]]]]] = []
    timed: list[tuple[float, dict[str, Any]]] | None = None
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        head = HEADER.match(line)
        if head:
            timed = [] if head.group(1).endswith("_matmul") or head.group(1) == "fg_matmul" else None
            if timed is not None:
                out.append(((int(head.group(2)), int(head.group(3)), int(head.group(4))), timed))
            continue
        row = ROW.match(line)
        if row and timed is not None and row.group(1) != "failed":
            timed.append((float(row.group(1)), json.loads(row.group(2))))
        elif not row:
            timed = None
    return out


def strip(config: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in config.items() if k != "backend"}, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    for path in args.files:
        gemms = read(path)
        wins: Counter[tuple[str, int]] = Counter()
        best_total = 0.0
        kept_total = dict.fromkeys(POLICIES, 0.0)
        compiles = dict.fromkeys(POLICIES, 0)
        for (m, n, k), timed in gemms:
            if not timed:
                continue
            tma = any(c.get("USE_TMA") for _, c in timed)
            order = [strip(c) for c in gemm_candidates(GemmGeometry((), m, n, k, (k, 1), (n, 1), (), ()), tma)]
            position: dict[str, tuple[str, int]] = {}
            seen: Counter[str] = Counter()
            for text in order:
                kd = kind(json.loads(text))
                position[text] = (kd, seen[kd])
                seen[kd] += 1
            ranked = [(ms, position.get(strip(c), ("cublas", 0) if c.get("backend") == "cublas" else ("?", -1)))
                      for ms, c in timed]
            best_ms, best_at = min(ranked)
            wins[best_at] += 1
            best_total += best_ms
            for name, (tiled, tiled_tma, persistent, splitk) in POLICIES.items():
                limit = {"tiled": tiled, "tiled TMA": tiled_tma, "persistent": persistent, "splitk": splitk}
                # a timed candidate the current lists no longer hold ("?": pruned since the run) is not kept
                kept = [ms for ms, (kd, pos) in ranked if kd == "cublas" or (kd != "?" and pos < limit.get(kd, 99))]
                kept_total[name] += min(kept) if kept else best_ms
                compiles[name] += sum(1 for text in order if position[text][1] < limit.get(position[text][0], 99))
        gone = sum(1 for (m, n, k), timed in gemms for _, c in timed if c.get("backend") != "cublas"
                   and strip(c) not in {strip(x) for x in gemm_candidates(
                       GemmGeometry((), m, n, k, (k, 1), (n, 1), (), ()), any(t.get("USE_TMA") for _, t in timed))})
        print(f"{path}: {len(gemms)} GEMMs with shapes"
              + (f"; {gone} timed candidates are gone from gemm_configs' lists (no policy keeps them)" if gone else ""))
        print("  wins by (kind, position in gemm_configs' order):")
        for (kd, pos), count in sorted(wins.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"    {kd:12s} #{pos}: {count}")
        for name in POLICIES:
            slower = kept_total[name] / best_total if best_total else 1.0
            print(f"  keep {name:30s}: {compiles[name]:4d} Triton compiles, best kept / best = {slower:.4f}")
        for gate in GATES:
            saved, kept_ms = 0, 0.0
            for (m, n, k), timed in gemms:
                if not timed:
                    continue
                gated = _gated(m, n, k, timed, gate)
                if gated is None:
                    kept_ms += min(ms for ms, _ in timed)
                    continue
                saved += gated[0]
                kept_ms += gated[1]
            slower = kept_ms / best_total if best_total else 1.0
            print(f"  gate: the rest only when the first tile is within {gate:.0%} of cuBLAS: "
                  f"{saved:4d} Triton compiles saved, best kept / best = {slower:.4f}")


# two-phase tuning, evaluated on the recorded times: time cuBLAS and the first Triton candidate (gemm_configs'
# order) first; compile and time the others only when that one is within `gate` of cuBLAS (or faster)
GATES = (0.05, 0.10, 0.20)


def _gated(m: int, n: int, k: int, timed: list[tuple[float, dict[str, Any]]],
           gate: float) -> tuple[int, float] | None:
    """(Triton compiles saved, the time of the candidate kept) under the gate, or None when the GEMM has no
    cuBLAS time or its first Triton candidate was not timed (the full search stands)."""
    tma = any(c.get("USE_TMA") for _, c in timed)
    order = [strip(c) for c in gemm_candidates(GemmGeometry((), m, n, k, (k, 1), (n, 1), (), ()), tma)]
    by_text = {strip(c): ms for ms, c in timed if c.get("backend") != "cublas"}
    cublas = [ms for ms, c in timed if c.get("backend") == "cublas"]
    if not cublas or not order or order[0] not in by_text:
        return None
    first = by_text[order[0]]
    if first <= cublas[0] * (1 + gate):
        return 0, min(ms for ms, _ in timed)
    return len(order) - 1, min(first, cublas[0])


if __name__ == "__main__":
    sys.exit(main())
