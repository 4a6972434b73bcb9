"""Do cuDNN frontend plan builds overlap in threads? ResNet-50's cold compile spends most of its time
building fused conv + scale + shift (+ residual) + ReLU plans (up to four candidates per graph, each
built then timed). This builds those plans for ResNet-50's conv shapes once one after another and
once from a thread pool (one cuDNN handle per thread), and prints the wall time of each.

    PYTHONPATH=src python bench/cudnn_build_threads_gpu.py [--threads 8] [--plans 4]
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

# (N, C, H, W, K, R, stride, pad) of ResNet-50's convolutions at batch 128 (one per distinct shape)
SHAPES = [(128, 64, 56, 56, 64, 1, 1, 0), (128, 64, 56, 56, 64, 3, 1, 1), (128, 64, 56, 56, 256, 1, 1, 0),
          (128, 256, 56, 56, 64, 1, 1, 0), (128, 256, 56, 56, 128, 1, 1, 0), (128, 128, 56, 56, 128, 3, 2, 1),
          (128, 128, 28, 28, 512, 1, 1, 0), (128, 512, 28, 28, 128, 1, 1, 0), (128, 128, 28, 28, 128, 3, 1, 1),
          (128, 512, 28, 28, 256, 1, 1, 0), (128, 256, 28, 28, 256, 3, 2, 1), (128, 256, 14, 14, 1024, 1, 1, 0),
          (128, 1024, 14, 14, 256, 1, 1, 0), (128, 256, 14, 14, 256, 3, 1, 1), (128, 1024, 14, 14, 512, 1, 1, 0),
          (128, 512, 14, 14, 512, 3, 2, 1)]


def nhwc(n: int, c: int, h: int, w: int) -> list[int]:
    return [c * h * w, 1, c * w, c]


def build(cudnn: Any, handle: Any, shape: tuple[int, ...], plans: int) -> int:
    n, c, h, w, k, r, stride, pad = shape
    bf16, fp32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    x = g.tensor(name="x", dim=[n, c, h, w], stride=nhwc(n, c, h, w), data_type=bf16)
    wt = g.tensor(name="w", dim=[k, c, r, r], stride=nhwc(k, c, r, r), data_type=bf16)
    y = g.conv_fprop(image=x, weight=wt, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                     compute_data_type=fp32)
    scale = g.tensor(name="scale", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=fp32)
    shift = g.tensor(name="shift", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=fp32)
    y = g.relu(input=g.add(a=g.mul(a=y, b=scale, compute_data_type=fp32), b=shift, compute_data_type=fp32))
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    y.set_output(True).set_data_type(bf16).set_dim([n, k, ho, wo]).set_stride(nhwc(n, k, ho, wo))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    built = 0
    for i in range(min(plans, int(g.get_execution_plan_count()))):
        try:
            g.build_plan_at_index(i)
            built += 1
        except Exception:  # an engine that does not build here
            pass
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--plans", type=int, default=4)
    args = parser.parse_args()
    import cudnn
    torch.cuda.init()
    handles: dict[int, Any] = {}
    lock = threading.Lock()

    def handle() -> Any:
        ident = threading.get_ident()
        with lock:
            if ident not in handles:
                handles[ident] = cudnn.create_handle()
            return handles[ident]

    build(cudnn, handle(), SHAPES[0], 1)   # library loading and first-use costs out of the timings
    # each pass at another batch size (no plan of an earlier pass can be reused); a third, sequential
    # again, shows whether later passes gain from anything cuDNN kept
    passes = (("sequential", 128), (f"{args.threads} threads", 64), ("sequential", 32))
    for label, batch in passes:
        shapes = [(batch, *s[1:]) for s in SHAPES]
        start = time.perf_counter()
        if label == "sequential":
            built = sum(build(cudnn, handle(), s, args.plans) for s in shapes)
        else:
            def job(s: tuple[int, ...]) -> int:
                torch.cuda.set_device(0)
                return build(cudnn, handle(), s, args.plans)
            with ThreadPoolExecutor(args.threads) as pool:
                built = sum(pool.map(job, shapes))
        wall = time.perf_counter() - start
        print(f"{label:12s} batch {batch:3d}: {len(shapes)} graphs, {built} plans built in {wall:.2f} s "
              f"({wall / max(built, 1) * 1e3:.0f} ms per plan)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
