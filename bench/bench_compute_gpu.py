"""Compute-bound workloads on the GPU, side by side in one process (BENCHMARKS.md protocol):

  gelu_mlp        gelu(x @ W1 + b1) @ W2 + b2, x 8192x4096, W1 4096x16384, W2 16384x4096 (bf16)
                  vs eager and torch.compile(mode="max-autotune-no-cudagraphs")
  sdpa_causal     causal attention forward, B4 H32 S4096 D128 (bf16), TFLOP/s
                  vs torch SDPA with the cuDNN and FlashAttention backends
  conv_bias_relu  relu(conv2d(x, w, b, padding=1)), NHWC 128x256x56x56, 256 filters 3x3 (bf16)
                  vs eager and torch.compile
  llama_prefill   Llama decoder block (RMSNorm, QKV, RoPE, causal GQA attention, O, SwiGLU), batch 4 x seq
                  2048, d 4096, 32 heads / 8 kv heads, ffn 11008 (bf16), built with the Graph API, vs the
                  same block as an nn.Module (bench/llama_blocks.py) eager, torch.compile (default and
                  max-autotune-no-cudagraphs) and through fg.compile
  sdpa_causal_bwd causal attention backward, B4 H16 S4096 D128 (bf16), TFLOP/s with FLOPs = 2.5x the causal
                  forward's, vs torch SDPA backward with the cuDNN, FlashAttention and efficient backends
  attention_memory  causal attention forward and forward+backward at S = 4k, 8k, 16k, 32k (B1 H16 D128
                  bf16): memory a call allocates vs one S x S bf16 score matrix (S*S*2 bytes)
  gelu_mlp also runs its JAX/XLA twin (fusegraph.perf.jax_twins, in a subprocess) when jax is installed.

Correct first: each fusegraph plan is compared with the reference executor (or fp32 torch) on
fresh random data and a failed check marks the row. Times are device time, the median of
triton.testing.do_bench (events around each call, L2 flushed). Results: JSON in $OUT (else
bench/results/) with versions, and a table on stdout.

    PYTHONPATH=src python bench/bench_compute_gpu.py [--only gelu_mlp,sdpa_causal,conv_bias_relu] [--small]
    PYTHONPATH=src python bench/bench_compute_gpu.py --only llama_prefill --llama-batch 1
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/bench_compute_gpu.py --cpu-smoke   # tiny, CPU, float16
"""

from __future__ import annotations

import argparse
import functools
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
    jax_note = _jax_gelu_mlp(t, d, h, times) if RUN["jax"] else "skipped (--no-jax)"
    return {"workload": "gelu_mlp", "shape": f"x {t}x{d}, W1 {d}x{h}", "rel_err": err, "ok": err <= 2e-2,
            "ms": times, "tflops": {k: flops / v / 1e9 for k, v in times.items()},
            "ratio_vs": {k: v / times["fusegraph"] for k, v in times.items() if k != "fusegraph"},
            "build_s": build_s, "compile_s_torch": compile_s, "kernels": _kernels(plan), "jax": jax_note}


def _jax_gelu_mlp(t: int, d: int, h: int, times: dict[str, float]) -> str:
    """The JAX/XLA twin in a subprocess (fusegraph.perf.jax_twins; 100 async calls then block, host
    clock, median of 5: not do_bench's L2-flushed events, so compare with care). Adds a row to times."""
    from fusegraph.perf.bench import run_jax_twin
    from fusegraph.perf.workloads import select

    result = run_jax_twin(select("gelu_mlp")[0], {"T": t, "D": d, "H": h}, floor=1.0)
    if result.device_ms:
        times["jax/xla (jit)"] = result.device_ms
    return f"{result.note} compile {result.compile_cold_s}s" if result.device_ms else result.note


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


# ---- llama block prefill, attention backward, attention memory (issue 4) ----

# Set by main(): --cpu-smoke runs the workloads below tiny, on CPU, in float16 (the Triton interpreter's
# bf16 dot is wrong), through fusegraph only (no Inductor, no do_bench).
RUN: dict[str, Any] = {"device": "cuda", "dtype": BF16, "cpu": False, "llama_batch": 4, "llama_ffn": 11008,
                       "max_autotune": True, "jax": True}


def _time_ms(fn: Callable[[], Any]) -> float:
    if not RUN["cpu"]:
        return device_ms(fn)
    start = time.perf_counter()  # CPU smoke: one call after the checked one, wall clock
    fn()
    return (time.perf_counter() - start) * 1e3


def _torch_impls(fn: Callable[..., Any], gemm: bool) -> dict[str, Callable[..., Any]]:
    """torch.compile variants of `fn` (none on the CPU smoke run: that checks fusegraph only)."""
    if RUN["cpu"]:
        return {}
    impls = {"torch.compile": torch.compile(fn)}
    if gemm and RUN["max_autotune"]:
        impls["torch.compile max-autotune-no-cudagraphs"] = torch.compile(fn, mode="max-autotune-no-cudagraphs")
    return impls


def bench_llama_prefill(small: bool) -> dict[str, Any]:
    import copy

    from llama_blocks import LlamaBlock, LlamaSize, llama_prefill_graph, rope_tables
    from torch_backend_gpu import LOW_TOL

    dev, dt = RUN["device"], RUN["dtype"]
    if RUN["cpu"]:
        size = LlamaSize(batch=2, seq=32, dim=128, heads=4, kv_heads=2, ffn=256)
    elif small:
        size = LlamaSize(batch=RUN["llama_batch"], seq=512, dim=1024, heads=8, kv_heads=2, ffn=2816)
    else:
        size = LlamaSize(batch=RUN["llama_batch"], seq=2048, dim=4096, heads=32, kv_heads=8, ffn=RUN["llama_ffn"])
    torch.manual_seed(0)
    block32 = LlamaBlock(size).to(dev)
    block = copy.deepcopy(block32).to(dt)
    g, params = llama_prefill_graph(block, size, dt, dev)
    start = time.perf_counter()
    plan = g.build(device=dev)
    build_s = time.perf_counter() - start
    x = torch.randn(size.batch, size.seq, size.dim, device=dev, dtype=dt)
    cos, sin = rope_tables(size.seq, size.head_dim, dt, dev)
    with torch.no_grad():
        ref32 = block32(x.float(), cos.float(), sin.float())
        impls: dict[str, Callable[[], torch.Tensor]] = {
            "fusegraph": lambda: plan(x, cos, sin, *params), "eager": lambda: block(x, cos, sin)}
        backend = fg.compile(block)
        for name, compiled in {**_torch_impls(block, gemm=True), "fusegraph backend (fg.compile)": backend}.items():
            impls[name] = functools.partial(compiled, x, cos, sin)
        errors, compile_s, times, peaks, notes = {}, {"fusegraph": build_s}, {}, {}, {}
        for name, fn in impls.items():
            try:
                if name != "fusegraph" and name != "eager":
                    compile_s[name] = _first_call_s(fn) if not RUN["cpu"] else _wall_s(fn)
                errors[name] = rel_err(fn(), ref32)
                times[name] = _time_ms(fn)
                if not RUN["cpu"]:
                    peaks[name] = _peak_memory_mb(fn)
            except Exception as err:  # one implementation failing does not stop the others
                notes[name] = f"{type(err).__name__}: {str(err)[:300]}"
    eager_err = errors.get("eager", float("inf"))
    ok = all(e <= 2 * eager_err + LOW_TOL for e in errors.values()) and "fusegraph" in times
    report = getattr(backend, "fusegraph_report", None)
    row = _row("llama_prefill", str(size), errors.get("fusegraph", float("inf")), ok, times,
               size.prefill_flops(), build_s, plan)
    row.update({"errors_vs_fp32": errors, "compile_s": compile_s, "peak_extra_mb": peaks, "notes": notes,
                "fallback_ops": report.fallback_ops if report is not None else None,
                "ok_rule": f"every impl's error vs the fp32 block <= 2 x eager's + {LOW_TOL}"})
    return row


def _sdpa_graph(b: int, h: int, s: int, d: int, dt: torch.dtype, backward: bool) -> fg.Graph:
    """Causal attention forward (outputs out, lse), or forward + backward (outputs out, dq, dk, dv)."""
    name = str(dt).replace("torch.", "")
    g = fg.Graph(name="sdpa_fwd_bwd" if backward else "sdpa_fwd", compute_dtype="float32")
    q, k, v = (g.tensor((b, h, s, d), dtype=name, name=n) for n in "qkv")
    out, lse = g.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    if backward:
        go = g.tensor((b, h, s, d), dtype=name, name="grad_out")
        g.set_output(out, *g.sdpa_backward(go, q, k, v, out, lse, is_causal=True))
    else:
        g.set_output(out, lse)
    return g


def bench_sdpa_causal_bwd(small: bool) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = RUN["device"], RUN["dtype"]
    b, h, s, d = (1, 2, 64, 32) if RUN["cpu"] else (2, 8, 1024, 128) if small else (4, 16, 4096, 128)
    name = str(dt).replace("torch.", "")
    g = fg.Graph(name="sdpa_causal_bwd", compute_dtype="float32")
    go_, q_, k_, v_, o_ = (g.tensor((b, h, s, d), dtype=name, name=n) for n in ("grad_out", "q", "k", "v", "out"))
    lse_ = g.tensor((b, h, s), dtype="float32", name="lse")
    g.set_output(*g.sdpa_backward(go_, q_, k_, v_, o_, lse_, is_causal=True))
    plan, build_s = _timed_build_on(g, dev)
    forward = _sdpa_graph(b, h, s, d, dt, backward=False).build(device=dev)
    q, k, v, go = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(4))
    out, lse = forward(q, k, v)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.autograd.grad(F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=True),
                                  leaves, go.float())
    got = plan(go, q, k, v, out, lse)
    errors = {"fusegraph": max(rel_err(a, r) for a, r in zip(got, ref, strict=True))}
    times = {"fusegraph": _time_ms(lambda: plan(go, q, k, v, out, lse))}
    notes: dict[str, str] = {}
    backends = {} if RUN["cpu"] else {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                                       "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for label, backend in backends.items():
        try:
            tq, tk, tv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([backend]):
                tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

            def torch_bwd(o: torch.Tensor = tout, ins: tuple[torch.Tensor, ...] = (tq, tk, tv)) -> Any:
                return torch.autograd.grad(o, ins, go, retain_graph=True)
            errors[f"torch sdpa {label}"] = max(rel_err(a, r) for a, r in zip(torch_bwd(), ref, strict=True))
            times[f"torch sdpa {label}"] = _time_ms(torch_bwd)
        except RuntimeError as err:
            notes[f"torch sdpa {label}"] = f"not available ({str(err)[:120]})"
            print(f"  torch sdpa {label} backward: not available ({str(err)[:80]})")
    flops = 5 * (4 * b * h * s * s * d // 2) // 2  # 2.5x the causal forward (4*B*H*S*S*D, halved)
    row = _row("sdpa_causal_bwd", f"B{b} H{h} S{s} D{d} causal, backward only", errors["fusegraph"],
               errors["fusegraph"] <= 2e-2, times, flops, build_s, plan)
    row.update({"errors_vs_fp32": errors, "notes": notes})
    return row


def bench_attention_memory(small: bool) -> dict[str, Any]:
    """Memory one causal attention call allocates (outputs + workspace) as S doubles; an S x S score
    matrix would be S*S*2 bytes per head. The last query rows (which see every key) are checked."""
    dev = RUN["device"]
    b, h, d = (1, 2, 32) if RUN["cpu"] else (1, 16, 128)
    seqs = (64, 128) if RUN["cpu"] else (1024, 2048, 4096, 8192) if small else (4096, 8192, 16384, 32768)
    rows, plan = [], None
    for s in seqs:
        entry: dict[str, Any] = {"S": s, "sxs_bf16_mb_per_head": s * s * 2 / 2**20,
                                 "qkv_mb": 3 * b * h * s * d * 2 / 2**20}
        try:
            plan = _attention_memory_at(b, h, s, d, entry)
        except Exception as err:  # an OOM here is the finding (something S x S was allocated)
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(entry)
        if dev == "cuda":
            torch.cuda.empty_cache()
    worst_err = max((r.get("rel_err_last_rows", 0.0) for r in rows), default=0.0)
    measured = [r for r in rows if "fwd_bwd_mb" in r]
    ok = len(measured) == len(seqs) and worst_err <= 2e-2
    if not RUN["cpu"] and measured:
        ok = ok and all(r["fwd_mb"] < r["sxs_bf16_mb_per_head"] and r["fwd_bwd_mb"] < r["sxs_bf16_mb_per_head"]
                        for r in measured)
        growth = measured[-1]["fwd_bwd_mb"] / max(measured[0]["fwd_bwd_mb"], 1e-9)
        ok = ok and growth <= 1.25 * measured[-1]["S"] / measured[0]["S"]
    times = {f"fusegraph fwd S={r['S']}": r["fwd_ms"] for r in measured}
    flops = {f"fusegraph fwd S={r['S']}": 2 * b * h * r["S"] ** 2 * d for r in measured}
    row = {"workload": "attention_memory", "shape": f"B{b} H{h} D{d} causal, S={','.join(map(str, seqs))}",
           "rel_err": worst_err, "ok": ok, "ms": times,
           "tflops": {k_: flops[k_] / v_ / 1e9 for k_, v_ in times.items()}, "ratio_vs": {}, "build_s": 0.0,
           "kernels": _kernels(plan) if plan is not None else [], "memory": rows,
           "ok_rule": "every call allocates < one S x S bf16 matrix (S*S*2 B) and fwd+bwd memory grows at most "
                      "1.25x linearly from the first S to the last"}
    return row


def _attention_memory_at(b: int, h: int, s: int, d: int, entry: dict[str, Any]) -> Any:
    """Fill `entry` with memory, error and time of causal attention at sequence length s; the forward plan."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = RUN["device"], RUN["dtype"]
    fwd = _sdpa_graph(b, h, s, d, dt, backward=False).build(device=dev)
    fwd_bwd = _sdpa_graph(b, h, s, d, dt, backward=True).build(device=dev)
    q, k, v, go = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(4))
    entry["first_call_fwd_bwd_mb"] = _peak_memory_mb(lambda: fwd_bwd(q, k, v, go))  # with any warm-up
    out = fwd(q, k, v)[0]
    tail = min(128, s)
    entry["rel_err_last_rows"] = rel_err(out[:, :, -tail:], _causal_tail_reference(q, k, v, tail))
    entry["fwd_mb"] = _peak_memory_mb(lambda: fwd(q, k, v))
    entry["fwd_bwd_mb"] = _peak_memory_mb(lambda: fwd_bwd(q, k, v, go))
    entry["fwd_ms"] = _time_ms(lambda: fwd(q, k, v))
    entry["fwd_tflops"] = 2 * b * h * s * s * d / entry["fwd_ms"] / 1e9
    backends = {} if RUN["cpu"] else {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    for label, backend in backends.items():
        with sdpa_kernel([backend]):
            try:
                entry[f"torch_{label}_fwd_mb"] = _peak_memory_mb(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            except RuntimeError as err:
                entry[f"torch_{label}_fwd_mb"] = f"not available ({str(err)[:80]})"
    return fwd


def _causal_tail_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tail: int) -> torch.Tensor:
    """fp32 causal attention output of the last `tail` query rows only (no full S x S matrix)."""
    s = q.shape[-2]
    scores = q[:, :, -tail:].double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(s - tail, s, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(s, device=q.device)[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


def _timed_build_on(g: fg.Graph, dev: str) -> tuple[Any, float]:
    start = time.perf_counter()
    plan = g.build(device=dev)
    return plan, time.perf_counter() - start


def _wall_s(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _row(workload: str, shape: str, err: float, ok: bool, times: dict[str, float], flops: int, build_s: float,
         plan: Any) -> dict[str, Any]:
    base = times.get("fusegraph")
    return {"workload": workload, "shape": shape, "rel_err": err, "ok": ok, "ms": times,
            "tflops": {k: flops / v / 1e9 for k, v in times.items()},
            "ratio_vs": {k: v / base for k, v in times.items() if k != "fusegraph"} if base else {},
            "build_s": build_s, "kernels": _kernels(plan)}


def _peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Memory a call allocates beyond what is live before it (attention must not hold S x S)."""
    if not torch.cuda.is_available():  # CPU smoke run: nothing to measure
        fn()
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _kernels(plan: Any) -> list[dict[str, Any]]:
    return [{"name": k.name, "kind": k.kind, "backend": k.backend, "ops": k.ops, "config": k.config,
             "note": k.note} for k in plan.kernels]


WORKLOADS = {"gelu_mlp": bench_gelu_mlp, "sdpa_causal": bench_sdpa_causal, "conv_bias_relu": bench_conv_bias_relu,
             "llama_prefill": bench_llama_prefill, "sdpa_causal_bwd": bench_sdpa_causal_bwd,
             "attention_memory": bench_attention_memory}
CPU_SMOKE = ("llama_prefill", "sdpa_causal_bwd", "attention_memory")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--small", action="store_true", help="small shapes (a quick smoke run)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny shapes on CPU in float16 ({', '.join(CPU_SMOKE)}; fusegraph only; "
                             "run under TRITON_INTERPRET=1)")
    parser.add_argument("--llama-batch", type=int, default=4, help="llama_prefill batch (1-4; default 4)")
    parser.add_argument("--llama-ffn", type=int, default=11008, help="llama_prefill MLP width (11008 or 14336)")
    parser.add_argument("--no-max-autotune", action="store_true",
                        help="llama_prefill: skip torch.compile max-autotune-no-cudagraphs (its compile is slow)")
    parser.add_argument("--no-jax", action="store_true", help="gelu_mlp: skip the JAX/XLA twin")
    args = parser.parse_args()
    RUN.update(llama_batch=args.llama_batch, llama_ffn=args.llama_ffn, max_autotune=not args.no_max_autotune,
               jax=not args.no_jax)
    if args.cpu_smoke:
        RUN.update(device="cpu", dtype=torch.float16, cpu=True)
        if args.only == ",".join(WORKLOADS):
            args.only = ",".join(CPU_SMOKE)
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu-smoke)")
        return 2
    torch.manual_seed(0)
    import triton

    versions = {"gpu": torch.cuda.get_device_name() if not args.cpu_smoke else "cpu (smoke)",
                "torch": torch.__version__, "triton": triton.__version__,
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
    results = "/tmp" if args.cpu_smoke else os.path.join(os.path.dirname(__file__), "results")
    out_dir = os.environ.get("OUT") or results
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"compute_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"versions": versions, "small": args.small, "cpu_smoke": args.cpu_smoke, "run": RUN,
                   "argv": sys.argv[1:], "results": rows}, f, indent=1, default=str)
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
    for key in ("errors_vs_fp32", "compile_s", "peak_extra_mb", "notes", "fallback_ops", "jax"):
        if row.get(key):
            print(f"  {key}: {row[key]}")
    if row.get("memory"):
        print(f"  {'S':>6s} {'fwd MiB':>9s} {'fwd+bwd MiB':>12s} {'1st call':>9s} {'SxS MiB/head':>13s} "
              f"{'torch cudnn':>12s} {'torch flash':>12s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'err':>8s}")
    for e in row.get("memory", []):
        if "error" in e:
            print(f"  {e['S']:6d} ERROR {e['error']}")
            continue
        print(f"  {e['S']:6d} {e['fwd_mb']:9.1f} {e['fwd_bwd_mb']:12.1f} {e['first_call_fwd_bwd_mb']:9.1f} "
              f"{e['sxs_bf16_mb_per_head']:13.1f} {str(e.get('torch_cudnn_fwd_mb', '-'))[:12]:>12s} "
              f"{str(e.get('torch_flash_fwd_mb', '-'))[:12]:>12s} {e['fwd_ms']:8.3f} {e['fwd_tflops']:8.1f} "
              f"{e['rel_err_last_rows']:8.1e}")
    for k in row["kernels"]:
        print(f"    kernel {k['name']}: {k['kind']}/{k['backend']} {'+'.join(k['ops'])} {k['config']} {k['note']}")


if __name__ == "__main__":
    sys.exit(main())
