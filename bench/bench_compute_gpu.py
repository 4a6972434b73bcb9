"""Compute-bound workloads on the GPU, side by side in one process (BENCHMARKS.md protocol):

  gelu_mlp        gelu(x @ W1 + b1) @ W2 + b2, x 8192x4096, W1 4096x16384, W2 16384x4096 (bf16)
                  vs eager and torch.compile(mode="max-autotune-no-cudagraphs")
  sdpa_causal     causal attention forward, B4 H32 S4096 D128 (bf16), TFLOP/s
                  vs torch SDPA with the cuDNN and FlashAttention backends
  conv_bias_relu  relu(conv2d(x, w, b, padding=1)), NHWC 128x256x56x56, 256 filters 3x3 (bf16)
                  vs eager and torch.compile

Correct first: each fusegraph plan is compared with the reference executor (or fp32 torch) on
fresh random data and a failed check marks the row. Times are device time, the median of
triton.testing.do_bench (events around each call, L2 flushed). Results: JSON in $OUT (else
bench/results/) with versions, and a table on stdout.

    PYTHONPATH=src python bench/bench_compute_gpu.py [--only gelu_mlp,sdpa_causal,conv_bias_relu] [--small]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg

BF16 = torch.bfloat16


def device_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30)).item()


def _timed_build(g: fg.Graph) -> tuple[Any, float]:
    start = time.perf_counter()
    plan = g.build(device="cuda")
    return plan, time.perf_counter() - start


def _compile(fn: Callable[..., Any], mode: str | None) -> tuple[Callable[..., Any], float]:
    compiled = torch.compile(fn, mode=mode) if mode else torch.compile(fn)
    return compiled, 0.0


def _first_call_s(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_gelu_mlp(small: bool) -> dict[str, Any]:
    t, d, h = (1024, 512, 2048) if small else (8192, 4096, 16384)
    g = fg.Graph(name="gelu_mlp", compute_dtype="float32")
    x = g.tensor((t, d), dtype="bfloat16", name="x")
    w1, b1 = g.tensor((d, h), dtype="bfloat16", name="w1"), g.tensor((h,), dtype="bfloat16", name="b1")
    w2, b2 = g.tensor((h, d), dtype="bfloat16", name="w2"), g.tensor((d,), dtype="bfloat16", name="b2")
    y = g.add(g.matmul(g.gelu(g.add(g.matmul(x, w1), b1), approximate="tanh"), w2), b2)
    y.set_output()
    plan, build_s = _timed_build(g)
    feeds = [torch.randn(t, d, device="cuda", dtype=BF16), torch.randn(d, h, device="cuda", dtype=BF16) / d ** 0.5,
             torch.randn(h, device="cuda", dtype=BF16), torch.randn(h, d, device="cuda", dtype=BF16) / h ** 0.5,
             torch.randn(d, device="cuda", dtype=BF16)]
    got = plan(*feeds)
    ref = fg.reference(g)(*feeds)
    err = rel_err(got, ref)

    def eager(a: torch.Tensor, p: torch.Tensor, pb: torch.Tensor, q: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
        return F.gelu(a @ p + pb, approximate="tanh") @ q + qb

    compiled, _ = _compile(eager, "max-autotune-no-cudagraphs")
    compile_s = _first_call_s(lambda: compiled(*feeds))
    flops = 4 * t * d * h
    times = {"fusegraph": device_ms(lambda: plan(*feeds)), "eager": device_ms(lambda: eager(*feeds)),
             "torch.compile max-autotune": device_ms(lambda: compiled(*feeds))}
    return {"workload": "gelu_mlp", "shape": f"x {t}x{d}, W1 {d}x{h}", "rel_err": err, "ok": err <= 2e-2,
            "ms": times, "tflops": {k: flops / v / 1e9 for k, v in times.items()},
            "ratio_vs": {k: v / times["fusegraph"] for k, v in times.items() if k != "fusegraph"},
            "build_s": build_s, "compile_s_torch": compile_s, "kernels": _kernels(plan)}


def bench_sdpa_causal(small: bool) -> dict[str, Any]:
    b, h, s, d = (2, 8, 1024, 128) if small else (4, 32, 4096, 128)
    g = fg.Graph(name="sdpa_causal", compute_dtype="float32")
    q, k, v = (g.tensor((b, h, s, d), dtype="bfloat16", name=n) for n in "qkv")
    y = g.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.set_output()
    plan, build_s = _timed_build(g)
    feeds = [torch.randn(b, h, s, d, device="cuda", dtype=BF16) for _ in range(3)]
    got = plan(*feeds)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(feeds[0].float(), feeds[1].float(), feeds[2].float(), is_causal=True)
    err = rel_err(got, ref)
    flops = 2 * b * h * s * s * d  # 4*B*H*S*S*D halved for the causal triangle
    times = {"fusegraph": device_ms(lambda: plan(*feeds))}
    from fusegraph.backends.cudnn import torch_sdpa

    qt, kt, vt = feeds
    for backend in ("cudnn", "flash"):
        def call(be: str = backend) -> torch.Tensor:
            return torch_sdpa(qt, kt, vt, None, True, 1 / math.sqrt(d), be)
        try:
            call()
            times[f"torch sdpa {backend}"] = device_ms(call)
        except RuntimeError as err_:
            print(f"  torch sdpa {backend}: not available ({str(err_)[:80]})")
    peak_mem = _peak_memory_mb(lambda: plan(*feeds))
    return {"workload": "sdpa_causal", "shape": f"B{b} H{h} S{s} D{d}", "rel_err": err, "ok": err <= 2e-2,
            "ms": times, "tflops": {k_: flops / v_ / 1e9 for k_, v_ in times.items()},
            "ratio_vs": {k_: v_ / times["fusegraph"] for k_, v_ in times.items() if k_ != "fusegraph"},
            "build_s": build_s, "peak_extra_mb": peak_mem, "kernels": _kernels(plan)}


def bench_conv_bias_relu(small: bool) -> dict[str, Any]:
    n, c, hw, kf = (16, 64, 28, 64) if small else (128, 256, 56, 256)
    g = fg.Graph(name="conv_bias_relu", compute_dtype="float32")
    x = g.tensor((n, c, hw, hw), dtype="bfloat16", name="x", layout="NHWC")
    w = g.tensor((kf, c, 3, 3), dtype="bfloat16", name="w")
    bias = g.tensor((kf,), dtype="bfloat16", name="b")
    y = g.relu(g.conv2d(x, w, bias, padding=1))
    y.set_output()
    plan, build_s = _timed_build(g)
    feeds = [torch.randn(n, c, hw, hw, device="cuda", dtype=BF16).contiguous(memory_format=torch.channels_last),
             (torch.randn(kf, c, 3, 3, device="cuda", dtype=BF16) / (9 * c) ** 0.5),
             torch.randn(kf, device="cuda", dtype=BF16)]
    got = plan(*feeds)
    ref = fg.reference(g)(*feeds)
    err = rel_err(got, ref)

    def eager(a: torch.Tensor, p: torch.Tensor, pb: torch.Tensor) -> torch.Tensor:
        return F.relu(F.conv2d(a, p.contiguous(memory_format=torch.channels_last), pb, padding=1))

    compiled, _ = _compile(eager, None)
    compile_s = _first_call_s(lambda: compiled(*feeds))
    flops = 2 * n * kf * hw * hw * c * 9
    times = {"fusegraph": device_ms(lambda: plan(*feeds)), "eager": device_ms(lambda: eager(*feeds)),
             "torch.compile": device_ms(lambda: compiled(*feeds))}
    w_cl = feeds[1].contiguous(memory_format=torch.channels_last)
    try:  # cuDNN's own fused conv+bias+relu (the peer the target compares with)
        times["cudnn fused conv+bias+relu"] = device_ms(
            lambda: torch.cudnn_convolution_relu(feeds[0], w_cl, feeds[2], (1, 1), (1, 1), (1, 1), 1))
    except RuntimeError as err_:
        print(f"  torch.cudnn_convolution_relu: not available ({str(err_)[:80]})")
    return {"workload": "conv_bias_relu", "shape": f"NHWC {n}x{c}x{hw}x{hw}, K={kf} 3x3", "rel_err": err,
            "ok": err <= 2e-2, "ms": times, "tflops": {k: flops / v / 1e9 for k, v in times.items()},
            "ratio_vs": {k: v / times["fusegraph"] for k, v in times.items() if k != "fusegraph"},
            "build_s": build_s, "compile_s_torch": compile_s, "kernels": _kernels(plan)}


def _peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Memory a call allocates beyond what is live before it (attention must not hold S x S)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _kernels(plan: Any) -> list[dict[str, Any]]:
    return [{"name": k.name, "kind": k.kind, "backend": k.backend, "ops": k.ops, "config": k.config,
             "note": k.note} for k in plan.kernels]


WORKLOADS = {"gelu_mlp": bench_gelu_mlp, "sdpa_causal": bench_sdpa_causal, "conv_bias_relu": bench_conv_bias_relu}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--small", action="store_true", help="small shapes (a quick smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    import triton

    versions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "cudnn": torch.backends.cudnn.version(), "python": platform.python_version()}
    print(versions)
    rows, failed = [], False
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            row = WORKLOADS[name](args.small)
        except Exception as err:  # one workload failing does not stop the others
            import traceback

            traceback.print_exc()
            row = {"workload": name, "ok": False, "error": f"{type(err).__name__}: {err}"}
        row["wall_s"] = time.perf_counter() - start
        failed |= not row.get("ok", False)
        rows.append(row)
        _print_row(row)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"compute_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"versions": versions, "small": args.small, "results": rows}, f, indent=1, default=str)
    print(f"wrote {path}")
    return 1 if failed else 0


def _print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['workload']:16s} ERROR {row['error']}")
        return
    print(f"\n{row['workload']} ({row['shape']}): rel err {row['rel_err']:.2e} {'ok' if row['ok'] else 'WRONG'}, "
          f"build {row['build_s']:.1f}s")
    print(f"  {'impl':34s} {'ms':>9s} {'TFLOP/s':>9s} {'fusegraph speedup':>18s}")
    for impl, ms in row["ms"].items():
        ratio = row["ratio_vs"].get(impl)
        print(f"  {impl:34s} {ms:9.3f} {row['tflops'][impl]:9.1f} {'' if ratio is None else f'{ratio:.3f}x':>18s}")
    for k in row["kernels"]:
        print(f"    kernel {k['name']}: {k['kind']}/{k['backend']} {'+'.join(k['ops'])} {k['config']} {k['note']}")


if __name__ == "__main__":
    sys.exit(main())
