"""Memory-bound suite on the GPU: eager vs torch.compile vs fusegraph, side by side in one run.

    PYTHONPATH=src python bench/bench_memory_gpu.py [--quick] [--only softmax,rmsnorm]

Protocol (../shared/BENCHMARKS.md): each workload is first checked against eager PyTorch on fresh
random data (a failed check fails the run); then device time (CUDA-graph replay of many calls,
or 100 back-to-back calls between events if capture fails; median of 5) and per-call latency
(events around one call, median of 50). Floors use min bytes / copy bandwidth measured with a
Triton copy kernel (not a captured memcpy). Also: per-call host overhead of a one-kernel Plan.
Writes JSON to $OUT (or bench/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg

BF16 = torch.bfloat16
DEV = "cuda"


# ---------------------------------------------------------------- workloads
def add_layernorm(M: int = 16384, N: int = 4096) -> dict[str, Any]:
    x, r = torch.randn(M, N, device=DEV, dtype=BF16), torch.randn(M, N, device=DEV, dtype=BF16)
    w, b = torch.randn(N, device=DEV, dtype=BF16), torch.randn(N, device=DEV, dtype=BF16)

    def eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        h = x + r
        return h, F.layer_norm(h, (N,), w, b, 1e-5)

    g = fg.Graph("add_layernorm")
    gx, gr, gw, gb = (g.tensor_like(t, name=n) for t, n in ((x, "x"), (r, "r"), (w, "w"), (b, "b")))
    h = g.add(gx, gr)
    h.set_output()
    g.layernorm(h, weight=gw, bias=gb, eps=1e-5).set_output()
    return {"args": (x, r, w, b), "eager": eager, "graph": g, "bytes": 4 * M * N * 2}


def rmsnorm(M: int = 16384, N: int = 4096) -> dict[str, Any]:
    x, w = torch.randn(M, N, device=DEV, dtype=BF16), torch.randn(N, device=DEV, dtype=BF16)

    def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(BF16)

    g = fg.Graph("rmsnorm")
    gx, gw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    g.rmsnorm(gx, weight=gw, eps=1e-6).set_output()
    return {"args": (x, w), "eager": eager, "graph": g, "bytes": 2 * M * N * 2}


def softmax(M: int = 32768, N: int = 4096) -> dict[str, Any]:
    x = torch.randn(M, N, device=DEV, dtype=BF16)

    def eager(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.float(), -1).to(BF16)

    g = fg.Graph("softmax")
    g.softmax(g.tensor_like(x, name="x"), -1).set_output()
    return {"args": (x,), "eager": eager, "graph": g, "bytes": 2 * M * N * 2}


def bias_gelu(M: int = 16384, N: int = 4096) -> dict[str, Any]:
    x, b = torch.randn(M, N, device=DEV, dtype=BF16), torch.randn(N, device=DEV, dtype=BF16)

    def eager(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + b, approximate="tanh")

    g = fg.Graph("bias_gelu")
    gx, gb = g.tensor_like(x, name="x"), g.tensor_like(b, name="b")
    g.gelu(g.add(gx, gb), approximate="tanh").set_output()
    return {"args": (x, b), "eager": eager, "graph": g, "bytes": 2 * M * N * 2}


def cross_entropy(M: int = 32768, N: int = 4096) -> dict[str, Any]:
    x = torch.randn(M, N, device=DEV, dtype=BF16)
    t = torch.randint(0, N, (M,), device=DEV)

    def eager(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x, t)

    g = fg.Graph("cross_entropy")
    g.cross_entropy(g.tensor_like(x, name="x"), g.tensor_like(t, name="t")).set_output()
    return {"args": (x, t), "eager": eager, "graph": g, "bytes": M * N * 2}


def layernorm_backward(M: int = 16384, N: int = 4096) -> dict[str, Any]:
    gy, x = torch.randn(M, N, device=DEV, dtype=BF16), torch.randn(M, N, device=DEV, dtype=BF16)
    w = torch.randn(N, device=DEV, dtype=BF16)

    def eager(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
        xf, gf = x.float(), gy.float()
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
        xhat = (xf - mean) * rstd
        wg = gf * w.float()
        dx = rstd * (wg - wg.mean(-1, keepdim=True) - xhat * (wg * xhat).mean(-1, keepdim=True))
        return dx.to(BF16), (gf * xhat).sum(0).to(BF16), gf.sum(0).to(BF16)

    g = fg.Graph("layernorm_backward")
    ggy, gx, gw = g.tensor_like(gy, name="g"), g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    for out in g.layernorm_backward(ggy, gx, weight=gw, eps=1e-5):
        out.set_output()
    return {"args": (gy, x, w), "eager": eager, "graph": g, "bytes": 3 * M * N * 2}


WORKLOADS: dict[str, Callable[..., dict[str, Any]]] = {
    "add_layernorm": add_layernorm, "rmsnorm": rmsnorm, "softmax": softmax, "bias_gelu": bias_gelu,
    "cross_entropy": cross_entropy, "layernorm_backward": layernorm_backward,
}


# ---------------------------------------------------------------- timing
def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def device_time_ms(fn: Callable[[], Any], calls: int = 20) -> tuple[float, str]:
    """Median of 5 of (CUDA-graph replay of `calls` calls) / calls; 100 back-to-back calls if
    capture fails."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return statistics.median(times), "cuda-graph"
    except Exception as err:  # capture not possible: back-to-back launches
        torch.cuda.synchronize()
        print(f"    (graph capture failed: {type(err).__name__}: {str(err)[:80]}; using back-to-back)")
        times = []
        for _ in range(5):
            start.record()
            for _ in range(100):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 100)
        return statistics.median(times), "back-to-back"


def latency_ms(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a Triton copy kernel (read + write) over 1 GiB."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    n = (1 << 30) // 2
    a = torch.randn(n, device=DEV, dtype=BF16)
    b = torch.empty_like(a)
    grid = (triton.cdiv(n, 4096),)
    best = 0.0
    for _ in range(3):
        copy_kernel[grid](a, b, n, BLOCK=4096, num_warps=8)
    assert torch.equal(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        start.record()
        for _ in range(10):
            copy_kernel[grid](a, b, n, BLOCK=4096, num_warps=8)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * n * 2 * 10 / (start.elapsed_time(end) / 1e3))
    return best


def host_overhead_us() -> dict[str, float]:
    """Host time per call (GPU synchronized at the end) of: a one-kernel Plan, the same kernel
    through Triton's JIT, and through the compiled kernel's run (the launch itself)."""
    x = torch.randn(4096, device=DEV)
    g = fg.Graph("trivial")
    g.relu(g.tensor_like(x, name="x")).set_output()
    plan = g.build()
    kernel = plan.kernels[0]
    launcher = kernel.launch
    out = torch.empty_like(x)

    def jit_call() -> None:
        launcher.fn[launcher.grid](x, out, **launcher.constexprs, num_warps=launcher.num_warps)

    def measure(fn: Callable[[], Any], calls: int = 5000) -> float:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    result = {"plan_us": measure(lambda: plan(x)), "triton_jit_us": measure(jit_call),
              "eager_relu_us": measure(lambda: torch.relu(x))}
    direct = (getattr(launcher, "_compiled", None) or [None])[0]
    if direct is not None:
        result["direct_launch_us"] = measure(lambda: direct(x, out, *launcher.const_values))
        result["plan_overhead_beyond_launch_us"] = result["plan_us"] - result["direct_launch_us"]
    return result


# ---------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated workload names")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton

    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (Triton copy kernel): {bandwidth / 1e12:.2f} TB/s")
    rows: list[dict[str, Any]] = []
    failed = False
    for name in names:
        torch.manual_seed(0)
        w = WORKLOADS[name]()
        t_build = time.perf_counter()
        plan = w["graph"].build(device=DEV)
        build_s = time.perf_counter() - t_build
        fargs = w["args"]
        # correctness first, on fresh random data
        fresh = tuple(torch.randn_like(a) if a.is_floating_point() else torch.randint_like(a, 0, w["args"][0].shape[-1])
                      for a in fargs)
        outs, refs = _as_tuple(plan(*fresh)), _as_tuple(w["eager"](*fresh))
        errs = [rel_err(o.float(), r.float()) for o, r in zip(outs, refs, strict=True)]
        ok = all(e < 2e-2 for e in errs)
        failed |= not ok
        print(f"{name}: {len(plan.kernels)} kernel(s) {[k.backend for k in plan.kernels]}, build {build_s:.2f} s, "
              f"check {'ok' if ok else 'FAILED'} (rel errs {', '.join(f'{e:.1e}' for e in errs)})")
        if not ok:
            rows.append({"workload": name, "check": "failed", "errors": errs})
            continue
        candidates: dict[str, Callable[[], Any]] = {"eager": lambda w=w: w["eager"](*w["args"])}
        if not args.no_compile:
            compiled = torch.compile(w["eager"])
            compiled(*fargs)
            candidates["torch.compile"] = lambda c=compiled, w=w: c(*w["args"])
        candidates["fusegraph"] = lambda p=plan, a=fargs: p(*a)
        row: dict[str, Any] = {"workload": name, "min_bytes": w["bytes"], "kernels": len(plan.kernels),
                               "floor_ms": w["bytes"] / bandwidth * 1e3, "build_s": build_s, "errors": errs,
                               "configs": [k.config for k in plan.kernels]}
        for label, fn in candidates.items():
            dev_ms, how = device_time_ms(fn)
            row[label] = {"device_ms": dev_ms, "latency_ms": latency_ms(fn), "timing": how,
                          "pct_floor": 100 * row["floor_ms"] / dev_ms}
        rows.append(row)

    overhead = host_overhead_us()
    print()
    header = f"{'workload':<20} {'floor':>7} " + " ".join(f"{c:>22}" for c in ("eager", "torch.compile", "fusegraph"))
    print(header + "   fg/compile")
    for row in rows:
        if "floor_ms" not in row:
            print(f"{row['workload']:<20} CHECK FAILED {row['errors']}")
            continue
        cells = []
        for c in ("eager", "torch.compile", "fusegraph"):
            cells.append(f"{row[c]['device_ms']:.3f}ms {row[c]['pct_floor']:3.0f}% {row[c]['latency_ms']:.3f}"
                         if c in row else f"{'-':>22}")
        ratio = row["torch.compile"]["device_ms"] / row["fusegraph"]["device_ms"] if "torch.compile" in row else 0
        line = " ".join(f"{c:>22}" for c in cells)
        print(f"{row['workload']:<20} {row['floor_ms']:.3f} {line}   {ratio:.2f}x")
    print("(cells: device time, % of copy floor, per-call latency ms)")
    ratios = [r["torch.compile"]["device_ms"] / r["fusegraph"]["device_ms"] for r in rows if "torch.compile" in r]
    if ratios:
        print(f"geomean speedup over torch.compile: {statistics.geometric_mean(ratios):.2f}x")
    print("host overhead per call (us):", {k: round(v, 2) for k, v in overhead.items()})

    result = {"suite": "memory-bound", "rows": rows, "host_overhead_us": overhead,
              "copy_bandwidth_Bps": bandwidth, "versions": {
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "python": platform.python_version()}, "command": " ".join(sys.argv)}
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"memory_gpu_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
