"""Does a shared cuDNN kernel cache cut the fused conv plans' build time, and what does it cost at run
time? ResNet-50's cold compile is dominated by building fused conv + scale + shift (+ residual) + ReLU
plans (runtime-fusion engines compile a kernel per plan). cuDNN >= 9.4 keeps compiled kernels in a
kernel cache shared by graphs of the same topology (dynamic-shape graphs), and >= 9.10 serializes it.

Each mode runs in its own process (nothing cuDNN keeps in-process carries over), over ResNet-50's
distinct conv shapes with both of its epilogue forms, building the first --plans engine
configurations of every graph and timing each (a CUDA graph of 10 executions, replayed):
  plain   static-shape graphs, no kernel cache (what fusegraph did)
  cache   dynamic-shape graphs sharing one kernel cache, then serialized to a file
  warm    a new process: the serialized cache loaded, the same graphs built again

    PYTHONPATH=src python bench/cudnn_kernel_cache_gpu.py [--batch 128] [--plans 4]
    PYTHONPATH=src python bench/cudnn_kernel_cache_gpu.py --static-reuse   # the static plans' own reuse

Prints per mode the build seconds and, per graph, the fastest plan's device ms. --static-reuse instead
times, on a few of those graphs without a kernel cache: building plan i a second time, building i
after j, executing plan i by index after others were built, and a chosen plan's serialize() and
deserialize() into a fresh graph (with the result compared to the built plan's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

# (C, H, W, K, R, stride, pad) of ResNet-50's convolutions (one per distinct shape)
SHAPES = [(64, 56, 56, 64, 1, 1, 0), (64, 56, 56, 64, 3, 1, 1), (64, 56, 56, 256, 1, 1, 0),
          (256, 56, 56, 64, 1, 1, 0), (256, 56, 56, 128, 1, 1, 0), (128, 56, 56, 128, 3, 2, 1),
          (128, 28, 28, 512, 1, 1, 0), (512, 28, 28, 128, 1, 1, 0), (128, 28, 28, 128, 3, 1, 1),
          (512, 28, 28, 256, 1, 1, 0), (256, 28, 28, 256, 3, 2, 1), (256, 14, 14, 1024, 1, 1, 0),
          (1024, 14, 14, 256, 1, 1, 0), (256, 14, 14, 256, 3, 1, 1), (1024, 14, 14, 512, 1, 1, 0),
          (512, 14, 14, 512, 3, 2, 1)]


def nhwc(n: int, c: int, h: int, w: int) -> list[int]:
    return [c * h * w, 1, c * w, c]


def graph_for(cudnn: Any, handle: Any, cache: Any, batch: int, shape: tuple[int, ...],
              residual: bool) -> tuple[Any, dict[str, Any], tuple[int, ...]]:
    c, h, w, k, r, stride, pad = shape
    bf16, fp32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    extra = {"kernel_cache": cache, "is_dynamic_shape_enabled": True} if cache is not None else {}
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle, **extra)
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    t = {"x": g.tensor(name="x", dim=[batch, c, h, w], stride=nhwc(batch, c, h, w), data_type=bf16),
         "w": g.tensor(name="w", dim=[k, c, r, r], stride=nhwc(k, c, r, r), data_type=bf16),
         "scale": g.tensor(name="scale", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=fp32),
         "shift": g.tensor(name="shift", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=fp32)}
    y = g.conv_fprop(image=t["x"], weight=t["w"], padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                     compute_data_type=fp32, name="conv")
    y = g.add(a=g.mul(a=y, b=t["scale"], compute_data_type=fp32, name="scale"), b=t["shift"],
              compute_data_type=fp32, name="shift")
    if residual:
        t["residual"] = g.tensor(name="residual", dim=[batch, k, ho, wo], stride=nhwc(batch, k, ho, wo), data_type=bf16)
        y = g.add(a=y, b=t["residual"], compute_data_type=fp32, name="residual")
    y = g.relu(input=y, name="relu")
    y.set_output(True).set_data_type(bf16).set_dim([batch, k, ho, wo]).set_stride(nhwc(batch, k, ho, wo))
    t["y"] = y
    return g, t, (batch, k, ho, wo)


def bindings(t: dict[str, Any], batch: int, shape: tuple[int, ...], out: tuple[int, ...]) -> dict[Any, torch.Tensor]:
    c, h, w, k, r, _, _ = shape
    cl = torch.channels_last
    dev = "cuda"
    b = {t["x"]: torch.randn(batch, c, h, w, device=dev, dtype=torch.bfloat16).contiguous(memory_format=cl),
         t["w"]: (torch.randn(k, c, r, r, device=dev) / (c * r * r) ** 0.5).bfloat16().contiguous(memory_format=cl),
         t["scale"]: (torch.rand(k, device=dev) + 0.5).as_strided((1, k, 1, 1), (k, 1, k, k)),
         t["shift"]: torch.randn(k, device=dev).as_strided((1, k, 1, 1), (k, 1, k, k)),
         t["y"]: torch.empty(out, device=dev, dtype=torch.bfloat16).contiguous(memory_format=cl)}
    if "residual" in t:
        b[t["residual"]] = torch.randn(out, device=dev, dtype=torch.bfloat16).contiguous(memory_format=cl)
    return b


def child(mode: str, batch: int, plans: int, cache_file: str) -> dict[str, Any]:
    import cudnn

    from fusegraph.perf.timing import device_time

    torch.cuda.init()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    cache = None
    if mode in ("cache", "warm"):
        cache = cudnn.create_kernel_cache()
        if mode == "warm":
            with open(cache_file) as f:
                cache.deserialize(f.read())
    rows = []
    build_s = 0.0
    start_all = time.perf_counter()
    for shape in SHAPES:
        for residual in (False, True):
            if residual and shape[4] != 1:   # ResNet adds its residual after the 1x1 expansions
                continue
            t0 = time.perf_counter()
            g, t, out = graph_for(cudnn, handle, cache, batch, shape, residual)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            count = min(plans, int(g.get_execution_plan_count()))
            built = []
            for i in range(count):
                try:
                    g.build_plan_at_index(i)
                    built.append(i)
                except Exception:  # an engine that does not build here
                    pass
            seconds = time.perf_counter() - t0
            build_s += seconds
            b = bindings(t, batch, shape, out)
            times = {}
            for i in built:
                ws = torch.empty(max(int(g.get_workspace_size_plan_at_index(i)), 1), device="cuda", dtype=torch.uint8)

                def run(i: int = i, ws: torch.Tensor = ws) -> None:
                    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
                    g.execute_plan_at_index(b, ws, index=i, handle=handle)
                try:
                    times[i] = device_time(run, calls=10, repeats=3).ms
                except Exception as err:  # reported, not fatal
                    times[i] = f"{type(err).__name__}: {str(err)[:80]}"
            rows.append({"shape": shape, "residual": residual, "build_s": seconds, "plans": count, "ms": times})
    total = time.perf_counter() - start_all
    result: dict[str, Any] = {"mode": mode, "build_s": build_s, "total_s": total, "rows": rows}
    if mode == "cache":
        text = cache.serialize()
        with open(cache_file, "w") as f:
            f.write(text)
        result["cache_bytes"] = len(text)
    return result


def static_reuse(batch: int) -> None:
    import cudnn

    torch.cuda.init()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for shape, residual in ((SHAPES[0], True), (SHAPES[1], False), (SHAPES[11], True), (SHAPES[15], False)):
        g, t, out = graph_for(cudnn, handle, None, batch, shape, residual)
        prep = timed(lambda g=g: (g.validate(), g.build_operation_graph(),
                                  g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]),
                                  g.check_support()))
        count = min(3, int(g.get_execution_plan_count()))
        first = [timed(lambda i=i: g.build_plan_at_index(i)) for i in range(count)]
        again = [timed(lambda i=i: g.build_plan_at_index(i)) for i in range(count)]
        b = bindings(t, batch, shape, out)
        ws = torch.empty(max(int(g.get_workspace_size_plan_at_index(i)) for i in range(count)) + 1,
                         device="cuda", dtype=torch.uint8)
        results = []
        for i in range(count):
            g.execute_plan_at_index(b, ws, index=i, handle=handle)
            results.append(b[t["y"]].clone())
        same = [float((r.float() - results[0].float()).norm() / results[0].float().norm()) for r in results]
        g.build_plan_at_index(count - 1)
        blob_s = time.perf_counter()
        blob = g.serialize(as_bytes=True)
        blob_s = time.perf_counter() - blob_s
        fresh = cudnn.pygraph(handle=handle)
        deser = timed(lambda fresh=fresh, blob=blob: fresh.deserialize(handle, blob))
        y_again = torch.empty_like(b[t["y"]])
        by_uid = {tensor.get_uid(): b[tensor] for tensor in t.values()}
        by_uid[t["y"].get_uid()] = y_again
        ws2 = torch.empty(max(int(fresh.get_workspace_size()), 1), device="cuda", dtype=torch.uint8)
        run_s = timed(lambda: fresh.execute(by_uid, ws2, handle=handle))
        err = float((y_again.float() - results[count - 1].float()).norm() / results[count - 1].float().norm())
        def fmt(values: list[float], spec: str) -> str:
            return "[" + ", ".join(format(v, spec) for v in values) + "]"

        print(f"{shape} residual={residual}: prepare {prep:.3f} s; build plans {fmt(first, '.3f')} s, "
              f"again {fmt(again, '.3f')} s; by-index results vs plan 0 rel err {fmt(same, '.1e')}; "
              f"serialize {blob_s * 1e3:.1f} ms, {len(blob) / 1e3:.1f} kB; deserialize {deser * 1e3:.1f} ms; "
              f"first execute {run_s * 1e3:.1f} ms; rel err vs the built plan {err:.1e}", flush=True)


def best(ms: dict[Any, Any]) -> tuple[float, Any]:
    numbers = {int(k): v for k, v in ms.items() if isinstance(v, float)}
    if not numbers:
        return float("nan"), "-"
    i = min(numbers, key=numbers.__getitem__)
    return numbers[i], i


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--child", default="")
    parser.add_argument("--cache-file", default="")
    parser.add_argument("--static-reuse", action="store_true")
    args = parser.parse_args()
    if args.static_reuse:
        static_reuse(args.batch)
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.plans, args.cache_file)))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as root:
        cache_file = os.path.join(root, "kernel_cache.json")
        for mode in ("plain", "cache", "warm"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--batch", str(args.batch),
                   "--plans", str(args.plans), "--cache-file", cache_file]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=580)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode != 0 or not lines:
                print(f"{mode}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", flush=True)
                continue
            results[mode] = json.loads(lines[-1])
            r = results[mode]
            extra = f", serialized cache {r['cache_bytes'] / 1e6:.2f} MB" if "cache_bytes" in r else ""
            print(f"{mode:6s}: {len(r['rows'])} graphs built in {r['build_s']:.2f} s "
                  f"(whole loop {r['total_s']:.2f} s){extra}", flush=True)
    if "plain" not in results:
        return 1
    print("\nshape (C,H,W,K,R,stride,pad) residual | build s plain / cache / warm "
          "| best ms (plan) plain / cache / warm")
    ratios = []
    for k, row in enumerate(results["plain"]["rows"]):
        cells_b, cells_t = [], []
        base, _ = best(row["ms"])
        for mode in ("plain", "cache", "warm"):
            if mode not in results:
                cells_b.append("-")
                cells_t.append("-")
                continue
            other = results[mode]["rows"][k]
            ms, idx = best(other["ms"])
            cells_b.append(f"{other['build_s']:.3f}")
            cells_t.append(f"{ms:.4f} ({idx})")
            if mode == "cache":
                ratios.append(ms / base)
        name = f"{tuple(row['shape'])!s:32s} {row['residual']!s:5s}"
        print(f"{name} | {' / '.join(cells_b)} | {' / '.join(cells_t)}")
    if ratios:
        import statistics
        print(f"\nfastest plan with the kernel cache / without: geomean {statistics.geometric_mean(ratios):.3f}, "
              f"worst {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
