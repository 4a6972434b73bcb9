"""Host time of one call through torch.compile(backend=fusegraph), on the CPU: what the backend's glue
costs per call, apart from the kernels (which run through the torch reference here).

A small MLP (two 8x8 linear layers and a GELU, batch 2) compiled with fg.compile under each variant of
the `direct_call` setting, the variants timed in alternation: per round, 3000 calls each, microseconds
per call; the table gives the median over rounds.

    PYTHONPATH=src python bench/host_call_cpu.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FUSEGRAPH_USE_TRITON", "0")   # kernels through the torch reference: host time only

import torch

import fusegraph as fg
from fusegraph.settings import override


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    variants = {"direct_call on": True, "direct_call off": False}
    compiled = {}
    for name, on in variants.items():
        with override(direct_call=on), torch.no_grad():
            fn = fg.compile(model)
            fn(x)   # compiles under this variant's setting
        compiled[name] = fn
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in compiled.items():
                for _ in range(10):
                    fn(x)
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    for name, samples in times.items():
        print(f"{name:18s} {statistics.median(samples):7.1f} us per call (rounds: "
              f"{', '.join(f'{t:.1f}' for t in samples)})")


if __name__ == "__main__":
    main()
