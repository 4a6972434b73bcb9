"""Which CUDA kernels a demo block's Plan launches, and how long each takes (torch.profiler).

    PYTHONPATH=src python bench/profile_demo_block.py --block conv --size medium

Complements `plan.explain()` (one time per fusegraph Kernel) by showing the device kernels inside
each one (cuDNN/cuBLAS calls, layout copies, our Triton kernels), next to eager PyTorch's.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from fusegraph.commands.demo_blocks import SIZES, conv_block, transformer_block


def profile_calls(fn, label: str, calls: int = 20) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"\n== {label}: {calls} calls ==")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block", choices=("conv", "transformer"), default="conv")
    parser.add_argument("--size", choices=tuple(SIZES), default="medium")
    args = parser.parse_args()
    tsize, csize = SIZES[args.size]
    block = (conv_block(csize, torch.bfloat16, "cuda") if args.block == "conv"
             else transformer_block(tsize, torch.bfloat16, "cuda"))
    plan = block.graph.build()
    print(plan)
    inputs = list(block.feeds.values())
    profile_calls(lambda: plan(*inputs), f"fusegraph {block.name}")
    profile_calls(lambda: block.eager_in(torch.bfloat16), f"eager {block.name}")


if __name__ == "__main__":
    main()
