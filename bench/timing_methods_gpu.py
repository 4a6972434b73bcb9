"""Do our two timing methods agree on long tensor-core kernels, and if not, is the card's clock why?

`triton.testing.do_bench` (bench_compute_gpu.py's rows: 100 ms of calls back to back, each after an L2 flush)
and `fusegraph.tune.bench_ms` (the autotuner and the alternating benches: each call after a device spin
and an L2 flush) gave torch's cuDNN causal attention at B4 H32 S4096 D128 1.047 ms and 0.92-0.93 ms in the
same hour (bench/RESULTS.md, twenty-seventh session). This times a few kernels both ways in alternation and
prints wall-clock marks, so a clock/power log taken beside it (`nvidia-smi --query-gpu=timestamp,clocks.sm,
power.draw --format=csv -lms 100`) shows what the card ran at during each.

    PYTHONPATH=src python bench/timing_methods_gpu.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from out_files import write_report


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from fusegraph.tune import bench_ms

    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 16384, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(64 * 2 ** 20, device="cuda")

    def attention() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    kernels = {"cuDNN causal attention B4 H32 S4096 D128": (attention, 2 * 4 * 32 * 4096 ** 2 * 128),
               "cuBLAS GEMM 8192x16384x4096": (lambda: a @ w, 2 * 8192 * 16384 * 4096),
               "copy 256 MiB (memory-bound)": (lambda: x * 2.0, 0)}
    methods = {"do_bench (back to back)": lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median")),
               "bench_ms (spin between calls)": bench_ms}
    lines = [f"# python bench/timing_methods_gpu.py; {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    for name, (fn, flops) in kernels.items():
        fn()
        for rnd in range(3):
            for method, timer in methods.items():
                t0 = time.time()
                ms = timer(fn)
                rate = f"{flops / ms / 1e9:6.1f} TFLOP/s" if flops else ""
                lines.append(f"{name:<42} round {rnd} {method:<30} {ms * 1e3:8.1f} us {rate}  "
                             f"[wall {t0:.2f} .. {time.time():.2f}]")
                print(lines[-1], flush=True)
    write_report("timing_methods", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
