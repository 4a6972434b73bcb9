"""Two tuning-choice listings of the same workload (bench/warm_compile_gpu.py --choices, e.g. with and
without a tuning setting) compared choice by choice: how many tuned kernels picked the same winner,
the tuning seconds summed, and for each different winner what the second run's winner measured in
the first run against the first run's best (1.00 = as fast; the listings hold every candidate's time).

    python bench/compare_choices.py FIRST.txt SECOND.txt
"""

from __future__ import annotations

import contextlib
import sys


def blocks(path: str) -> list[tuple[str, list[tuple[float, str]]]]:
    """(header, [(ms, config), ...] winner first) per tuned kernel; failed candidates are left out."""
    out: list[tuple[str, list[tuple[float, str]]]] = []
    with open(path) as f:
        for line in f:
            if not line.startswith("    "):
                out.append((line.strip(), []))
                continue
            ms, _, config = line.strip().partition("  ")
            with contextlib.suppress(ValueError):   # "failed ...": left out
                out[-1][1].append((float(ms), config.strip()))
    return out


def tuned_seconds(listing: list[tuple[str, list[tuple[float, str]]]]) -> float:
    return sum(float(h.split("tuned in ")[1].split()[0]) for h, _ in listing if "tuned in " in h)


def compare(first: str, second: str) -> str:
    a, b = blocks(first), blocks(second)
    if [h.split("  ")[0] for h, _ in a] != [h.split("  ")[0] for h, _ in b]:
        return "the two listings hold different kernels (different workloads or code)"
    same, lines = 0, []
    for (head, ca), (_, cb) in zip(a, b, strict=True):
        if not ca or not cb:
            continue
        if ca[0][1] == cb[0][1]:
            same += 1
            continue
        in_first = {config: ms for ms, config in ca}.get(cb[0][1])
        ratio = f"{in_first / ca[0][0]:.3f}" if in_first else "not timed in the first run"
        lines.append(f"  {head.split(',')[0]}: second run's winner in the first run / its best = {ratio} "
                     f"(best {ca[0][0] * 1000:.1f} us in the first run, {cb[0][0] * 1000:.1f} us in the second)")
    tuned = sum(1 for _, c in a if c)
    return "\n".join([f"{tuned} tuned kernels: same winner {same}, different {tuned - same}; tuning seconds "
                      f"summed {tuned_seconds(a):.1f} (first) and {tuned_seconds(b):.1f} (second)", *lines])


if __name__ == "__main__":
    print(compare(sys.argv[1], sys.argv[2]))
