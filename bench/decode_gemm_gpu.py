"""Decode-step GEMMs (batch 1: x[1, K] @ W^T with W an nn.Linear weight [N, K], bf16) of a Llama
block: fusegraph's plan (whatever its autotuner chose) vs torch.mm (cuBLAS), timed two ways:

  isolated   the autotuner's protocol (tune.bench_ms: L2 flushed before each call, median)
  streaming  what a decode step sees: one call per layer on 16 different weights back to back
             (16 x the weight bytes, far beyond L2), events around the loop, per call

A choice that wins `isolated` but loses `streaming` means the tuning protocol misleads for
weight-streaming GEMMs.

    PYTHONPATH=src python bench/decode_gemm_gpu.py
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import fusegraph as fg
from fusegraph.tune import bench_ms

SHAPES = {"q/o proj": (4096, 4096), "k/v proj": (4096, 1024), "w1/w3": (4096, 11008), "w2": (11008, 4096)}
LAYERS = 16


def streaming_ms(fn: Any, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    for w in weights[:3]:
        fn(x, w)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for w in weights:
            fn(x, w)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / len(weights))
    return best


def main() -> None:
    rows: list[dict[str, Any]] = []
    for label, (k, n) in SHAPES.items():
        g = fg.Graph(name=f"decode_{k}x{n}")
        xh, wh = g.tensor((1, k), dtype="bfloat16", name="x"), g.tensor((n, k), dtype="bfloat16", name="w")
        g.matmul(xh, g.transpose(wh, 0, 1)).set_output()
        plan = g.build(device="cuda")
        kernel = next(kk for kk in plan.kernels if kk.kind == "matmul")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]

        def ours(x: torch.Tensor, w: torch.Tensor) -> Any:
            return plan(x, w)

        def cublas(x: torch.Tensor, w: torch.Tensor) -> Any:
            return torch.mm(x, w.t())

        err = float((ours(x, weights[0])[0].float() - cublas(x, weights[0]).float()).norm()
                    / cublas(x, weights[0]).float().norm())
        row = {"gemm": label, "K": k, "N": n, "weight_MB": n * k * 2 / 1e6, "chosen": kernel.backend,
               "config": {a: v for a, v in kernel.config.items() if a.isupper() or a == "backend"},
               "tuning": kernel.tuning, "rel_err": err}
        for name, fn in (("plan", ours), ("torch.mm", cublas)):
            row[f"{name} isolated ms"] = bench_ms(lambda fn=fn: fn(x, weights[0]))
            row[f"{name} streaming ms"] = streaming_ms(fn, weights, x)
        row["floor ms"] = n * k * 2 / 4.8e12 * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'gemm':10s} {'MB':>6s} {'chosen':8s} {'plan iso':>9s} {'mm iso':>8s} {'plan str':>9s} "
          f"{'mm str':>8s} {'floor':>7s}")
    for r in rows:
        print(f"{r['gemm']:10s} {r['weight_MB']:6.1f} {r['chosen']:8s} {r['plan isolated ms']:9.4f} "
              f"{r['torch.mm isolated ms']:8.4f} {r['plan streaming ms']:9.4f} {r['torch.mm streaming ms']:8.4f} "
              f"{r['floor ms']:7.4f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_gemm.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
