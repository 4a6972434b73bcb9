"""GPT-2-124M's LM head (M = 8192 tokens, K = 768, vocabulary N = 50257, bf16) as plan kernels,
built without the pad_align pass (passes/pad_align.py), with it (GEMM operands padded, the
default) and with settings.pad_results (GEMM results padded too: the logits), on the GPU.

The graph is the head of a training step, forward and backward in one plan:
    logits = h @ W^T                    GEMM 1 [8192, 50257] (plan-internal: padded with settings.pad_results)
    loss = cross_entropy(logits, y); dlogits = cross_entropy_backward(1/M, logits, y)
    dh = dlogits @ W                    GEMM 2 (K = 50257: our Triton GEMM had no TMA path)
    dW = dlogits^T @ h                  GEMM 3 (cuBLAS's align1 kernel on the 50257-element rows)
Each plan kernel is timed on its own (its recorded inputs, device time by CUDA events), then the
whole plan; the kernels the GPU ran are listed from a torch.profiler trace (cuBLAS kernel names
show align1 vs align8). Bare torch.mm rows on dense vs padded operands give the library's side, and
the one-time copy into a padded buffer what padding an input would cost. Text to stdout, JSON to
$OUT (else bench/results/).

    PYTHONPATH=src python bench/pad_align_gpu.py                 # H200: three builds (autotuned), ~2-4 min
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/pad_align_gpu.py --cpu-smoke   # tiny shapes, fp16, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
from fusegraph.passes.pad_align import pad_align_disabled, padded_row
from fusegraph.settings import override
from fusegraph.tune import bench_ms


def lm_head_graph(m: int, k: int, n: int, dtype: str) -> tuple[fg.Graph, list[Any]]:
    g = fg.Graph(name=f"lm_head_{m}x{k}x{n}", compute_dtype="float32")
    h = g.tensor((m, k), dtype=dtype, name="h")
    w = g.tensor((n, k), dtype=dtype, name="w")
    y = g.tensor((m,), dtype="int64", name="y")
    gloss = g.tensor((), dtype="float32", name="gloss")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    # reduction "sum" with the loss gradient 1/M (= "mean"): a mean loss next to its backward in
    # one plan hits a partitioner bug at HEAD (a kernel reading the token count it computes itself)
    g.cross_entropy(logits, y, reduction="sum", name="loss").set_output()
    dlogits = g.cross_entropy_backward(gloss, logits, y, reduction="sum", name="dlogits")
    g.matmul(dlogits, w, name="dh").set_output()
    g.matmul(g.transpose(dlogits, 0, 1), h, name="dw").set_output()
    return g, [h, w, y, gloss]


def zero_padded_graph(m: int, k: int, n: int, dtype: str) -> fg.Graph:
    """The three LM-head GEMMs on operands zero-padded to aligned dimensions (W's rows and g's
    columns to the padded row length), fp32 casts after the backward GEMMs as in the training step."""
    row = padded_row(n, torch.empty((), dtype=getattr(torch, dtype)).element_size()) or n
    g = fg.Graph(name=f"lm_head_zero_padded_{m}x{k}x{row}", compute_dtype="float32")
    h = g.tensor((m, k), dtype=dtype, name="h")
    wz = g.tensor((row, k), dtype=dtype, name="w_zero")
    gz = g.tensor((m, row), dtype=dtype, name="g_zero")
    g.matmul(h, wz, transpose_b=True, name="logits").set_output()
    g.cast(g.matmul(gz, wz, name="dh"), "float32").set_output()
    g.cast(g.matmul(g.transpose(gz, 0, 1), h, name="dw"), "float32").set_output()
    return g


def time_zero_padded(m: int, k: int, n: int, dtype: str, device: str) -> dict[str, Any]:
    g = zero_padded_graph(m, k, n, dtype)
    start = time.perf_counter()
    plan = g.build(device=device)
    build_s = time.perf_counter() - start
    dt = getattr(torch, dtype)
    h, w, _, _ = make_inputs(m, k, n, dt, device)
    row = g.inputs()[1].shape[0]
    wz = torch.zeros(row, k, dtype=dt, device=device)
    wz[:n].copy_(w)
    gz = torch.zeros(m, row, dtype=dt, device=device)
    gz[:, :n].copy_((torch.randn(m, n, device=device) * 1e-3).to(dt))
    inputs = [h, wz, gz]
    rows = kernel_rows(plan, inputs, timed=device.startswith("cuda"))
    return {"label": "zero-padded operands (N, K, M = padded row), GEMMs only", "build_s": round(build_s, 1),
            "kernels": rows}


def make_inputs(m: int, k: int, n: int, dt: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(m, k, generator=gen).to(dt).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dt).to(device)
    y = torch.randint(0, n, (m,), generator=gen).to(device)
    return [h, w, y, torch.tensor(1.0 / m, device=device)]


def kernel_rows(plan: Any, inputs: list[torch.Tensor], timed: bool) -> list[dict[str, Any]]:
    """Run the plan kernel by kernel (each its own launch, not the in-place variant), timing each."""
    buf: list[Any] = list(inputs) + [None] * (plan._num_slots - len(inputs))
    rows = []
    for kernel, ins, outs in plan._schedule:
        args = [buf[i] for i in ins]
        results = kernel.launch(args)
        for slot, r in zip(outs, results, strict=True):
            buf[slot] = r
        if kernel.kind in ("view", "constant"):
            continue
        row: dict[str, Any] = {"kernel": kernel.name, "kind": kernel.kind, "backend": kernel.backend,
                               "ops": "+".join(kernel.ops)[:60],
                               "config": {a: v for a, v in (kernel.config or {}).items()
                                          if a in ("backend", "VARIANT", "USE_TMA", "BLOCK_M", "BLOCK_N", "BLOCK_K")},
                               "in_strides": [tuple(n.spec.memory_strides) for n in kernel.inputs if n.shape],
                               "out_strides": [tuple(n.spec.memory_strides) for n in kernel.outputs if n.shape],
                               "tuning": {a: v for a, v in (kernel.tuning or {}).items()
                                          if a in ("source", "candidates", "timed", "best_ms", "seconds")},
                               "note": kernel.note}
        if timed:
            launch, kernel_args = kernel.launch, args
            row["ms"] = bench_ms(lambda: launch(kernel_args))
        rows.append(row)
    return rows


def gpu_kernels(fn: Callable[[], Any], top: int = 14) -> list[tuple[str, float]]:
    """(kernel name, ms) of one call of `fn` by torch.profiler, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA":
            totals[evt.name] = totals.get(evt.name, 0.0) + evt.device_time_total / 1e3
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def build_and_time(label: str, m: int, k: int, n: int, dtype: str, device: str, mode: str) -> dict[str, Any]:
    """mode: "off" (no pad_align), "on" (the default: GEMM operands), "results" (settings.pad_results too)."""
    g, _ = lm_head_graph(m, k, n, dtype)
    start = time.perf_counter()
    if mode == "off":
        with pad_align_disabled():
            plan = g.build(device=device)
    else:
        with override(pad_results=mode == "results"):
            plan = g.build(device=device)
    build_s = time.perf_counter() - start
    inputs = make_inputs(m, k, n, getattr(torch, dtype), device)
    cuda = device.startswith("cuda")
    rows = kernel_rows(plan, inputs, timed=cuda)
    out = plan(*inputs)
    res: dict[str, Any] = {"label": label, "build_s": round(build_s, 1), "kernels": rows,
                           "outputs": [o.float() for o in out]}
    if cuda:
        res["plan_ms"] = bench_ms(lambda: plan(*inputs))
        try:
            res["gpu_kernels"] = gpu_kernels(lambda: plan(*inputs))
        except Exception as err:  # the profiler is a diagnostic only
            res["gpu_kernels"] = [(f"profiler failed: {type(err).__name__}: {err}", 0.0)]
    return res


def bare_cublas(m: int, k: int, n: int, dt: torch.dtype, device: str) -> list[dict[str, Any]]:
    """torch.mm on dense (misaligned) vs padded [m, n] operands/results, and the padding copy."""
    row = padded_row(n, torch.empty((), dtype=dt).element_size()) or n
    h = torch.randn(m, k, device=device).to(dt)
    w = (torch.randn(n, k, device=device) * 0.02).to(dt)
    dense = (torch.randn(m, n, device=device) * 1e-3).to(dt)
    padded = torch.empty_strided((m, n), (row, 1), dtype=dt, device=device).copy_(dense)
    out_pad = torch.empty_strided((m, n), (row, 1), dtype=dt, device=device)
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("logits = h @ W^T, dense out", lambda: torch.mm(h, w.t()), 2 * m * n * k),
        ("logits = h @ W^T, padded out", lambda: torch.mm(h, w.t(), out=out_pad), 2 * m * n * k),
        ("dh = g @ W, dense g", lambda: torch.mm(dense, w), 2 * m * n * k),
        ("dh = g @ W, padded g", lambda: torch.mm(padded, w), 2 * m * n * k),
        ("dW = g^T @ h, dense g", lambda: torch.mm(dense.t(), h), 2 * m * n * k),
        ("dW = g^T @ h, padded g", lambda: torch.mm(padded.t(), h), 2 * m * n * k),
        ("copy g into the padded buffer", lambda: padded.copy_(dense), 0),
    ]
    # zero padding (the padded rows / columns hold 0, so they may join a GEMM's N or K): W's rows to
    # `row`, g's columns to `row`, the GEMMs run on aligned dimensions and the results are sliced
    w_zero = torch.zeros(row, k, dtype=dt, device=device)
    w_zero[:n].copy_(w)
    g_zero = torch.zeros(m, row, dtype=dt, device=device)
    g_zero[:, :n].copy_(dense)
    cases += [
        ("logits = h @ Wz^T, N zero-padded", lambda: torch.mm(h, w_zero.t()), 2 * m * n * k),
        ("dh = gz @ Wz, K zero-padded", lambda: torch.mm(g_zero, w_zero), 2 * m * n * k),
        ("dW = gz^T @ h, M zero-padded", lambda: torch.mm(g_zero.t(), h), 2 * m * n * k),
        ("copy W into its zero-padded buffer", lambda: w_zero[:n].copy_(w), 0),
    ]
    try:
        torch.mm(g_zero, w_zero, out_dtype=torch.float32)
        cases += [("dh = gz @ Wz, K zero-padded, fp32 out", lambda: torch.mm(g_zero, w_zero, out_dtype=torch.float32),
                   2 * m * n * k),
                  ("dW = gz^T @ h, fp32 out", lambda: torch.mm(g_zero.t(), h, out_dtype=torch.float32), 2 * m * n * k)]
    except (TypeError, RuntimeError) as err:
        print(f"torch.mm(out_dtype=) not available: {err}")
    out = []
    for name, fn, flops in cases:
        ms = bench_ms(fn)
        out.append({"case": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None})
    return out


def _print(res: dict[str, Any]) -> None:
    print(f"\n== {res['label']}: build {res['build_s']} s" +
          (f", whole plan {res['plan_ms']:.3f} ms" if "plan_ms" in res else ""))
    for r in res["kernels"]:
        ms = f"{r['ms']:8.3f} ms" if "ms" in r else "       -   "
        print(f"  {ms}  {r['kind']:9s} {r['backend']:9s} {r['ops']:40s} in {r['in_strides']} "
              f"out {r['out_strides']} {r['config']}" + (f" tuning {r['tuning']}" if r["tuning"] else ""))
    for name, ms in res.get("gpu_kernels", []):
        print(f"     gpu {ms:8.3f} ms  {name[:150]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in fp16 on the CPU (interpreter)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare torch.mm rows")
    opts = parser.parse_args()
    device = "cpu" if opts.cpu_smoke else "cuda"
    m, k, n = (64, 32, 1001) if opts.cpu_smoke else (8192, 768, 50257)
    dtype = "float16" if opts.cpu_smoke else "bfloat16"
    t0 = time.perf_counter()
    results = [build_and_time("without pad_align", m, k, n, dtype, device, "off"),
               build_and_time("with pad_align", m, k, n, dtype, device, "on"),
               build_and_time("with pad_align, settings.pad_results (logits padded too)", m, k, n, dtype, device,
                              "results")]
    zero = time_zero_padded(m, k, n, dtype, device)
    for res in [*results, zero]:
        _print(res)
        sys.stdout.flush()
    base = results[0].pop("outputs")
    agree = []
    for res in results[1:]:
        errs = []
        for a, b in zip(base, res.pop("outputs"), strict=True):
            denom = float(a.double().norm()) or 1.0
            errs.append(float((a.double() - b.double()).norm()) / denom)
        agree.append(errs)
        diffs = ", ".join(f"{e:.2e}" for e in errs)
        print(f"\noutputs {res['label']} vs without (loss, dh, dW): relative differences {diffs}")
    gemm_ms = {r["label"]: sum(x.get("ms", 0.0) for x in r["kernels"] if x["kind"] == "matmul")
               for r in [*results, zero]}
    print(f"GEMM kernels summed: {', '.join(f'{k_}: {v:.3f} ms' for k_, v in gemm_ms.items())}")
    bare = [] if opts.no_bare or opts.cpu_smoke else bare_cublas(m, k, n, getattr(torch, dtype), device)
    for r in bare:
        tf = f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else ""
        print(f"  bare {r['ms']:8.3f} ms  {r['case']:34s} {tf}")
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "shape": {"m": m, "k": k, "n": n, "dtype": dtype}, "seconds": round(time.perf_counter() - t0, 1),
            "relative_difference": agree, "gemm_ms": gemm_ms}
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"pad_align_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"info": info, "plans": [*results, zero], "bare_cublas": bare}, f, indent=1, default=str)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
