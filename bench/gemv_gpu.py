"""How fast can a Triton GEMV stream a decode step's weights, against cuBLAS (torch.mm)?

The Llama decode step (d4096, 32/8 heads, ffn 11008, batch 1) is seven GEMVs y[1, N] = x[1, K] @ W[N, K]^T
that read 354 MB of bf16 weights. This script times, per shape, a plain weight-streaming Triton kernel
(BLOCK_N rows per program, fp32 partial products over BLOCK_K columns, one sum at the end) over a sweep of
configs, against torch.mm, each in two ways:

  isolated   one GEMV, rotating over enough weight copies that each call reads from HBM, not L2
             (a 33 MB weight fits the H200's 50 MB L2)
  streaming  the seven GEMVs back to back in one CUDA graph, as a decode step issues them

    PYTHONPATH=src python bench/gemv_gpu.py [--configs all|best]

Results to stdout (and $OUT/gemv.txt when OUT is set).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_syncs_gpu import emit

SHAPES = [("q", 4096, 4096), ("k", 4096, 1024), ("v", 4096, 1024), ("o", 4096, 4096),
          ("w1", 4096, 11008), ("w3", 4096, 11008), ("w2", 11008, 4096)]   # (name, K, N)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_row = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + rk)
            w = tl.load(w_row + (k + rk)[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_ok = k + rk < K
            x = tl.load(x_ptr + k + rk, mask=k_ok, other=0.0)
            w = tl.load(w_row + (k + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict) -> None:
    n, k = w.shape
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    gemv_kernel[grid](x, w, y, n, k, w.stride(0), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                      EVEN_K=k % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def configs() -> list[dict]:
    out = []
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 3)):
        if bn * bk > 16384 or bn * bk < 512:
            continue
        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
    return out


def graph_time(fn, reps: int = 20) -> float:
    """ms per call of fn, captured `reps` times in one CUDA graph, median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times[1:])[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=4, help="configs shown per shape")
    args = parser.parse_args()

    def say(line: str) -> None:
        emit(line, "gemv.txt")

    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    dt = torch.bfloat16
    best: dict[str, dict] = {}
    weights: dict[str, torch.Tensor] = {}
    xs: dict[str, torch.Tensor] = {}
    for name, k, n in SHAPES:
        copies = max(2, int(200e6 // (n * k * 2)) + 1)   # > 4x the L2 per rotation
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=dt)
        y = torch.empty(1, n, device="cuda", dtype=dt)
        ref = (x.float() @ ws[0].float().t())
        floor_ms = n * k * 2 / 4.2e12 * 1e3
        state = {"i": 0}

        def mm() -> None:
            state["i"] = (state["i"] + 1) % copies
            torch.mm(x, ws[state["i"]].t(), out=y)

        t_mm = graph_time(mm, reps=copies * 2)
        rows = []
        for cfg in configs():
            try:
                launch(x, ws[0], y, cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if err > 2e-2:
                    say(f"  {name} {cfg} WRONG rel err {err:.3g}")
                    continue

                def tr(cfg: dict = cfg) -> None:
                    state["i"] = (state["i"] + 1) % copies
                    launch(x, ws[state["i"]], y, cfg)
                rows.append((graph_time(tr, reps=copies * 2), cfg))
            except Exception as exc:  # a config that does not build is reported and skipped
                say(f"  {name} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
        rows.sort(key=lambda r: r[0])
        say(f"{name:3s} K={k:5d} N={n:5d} {n * k * 2 / 1e6:6.1f} MB floor {floor_ms * 1e3:6.1f} us | cuBLAS "
            f"{t_mm * 1e3:6.1f} us ({n * k * 2 / t_mm / 1e9:5.2f} TB/s)")
        for t, cfg in rows[:args.top]:
            say(f"      triton {t * 1e3:6.1f} us ({n * k * 2 / t / 1e9:5.2f} TB/s) {cfg}")
        best[name] = rows[0][1]
        weights[name], xs[name] = ws[0], x

    # streaming: the seven back to back, one input each (the step's data dependencies do not change bytes)
    ys = {name: torch.empty(1, w.shape[0], device="cuda", dtype=dt) for name, w in weights.items()}

    def step_mm() -> None:
        for name in weights:
            torch.mm(xs[name], weights[name].t(), out=ys[name])

    def step_tr() -> None:
        for name in weights:
            launch(xs[name], weights[name], ys[name], best[name])

    total = sum(w.numel() * 2 for w in weights.values())
    for label, fn in (("cuBLAS", step_mm), ("triton best", step_tr)):
        t = graph_time(fn, reps=1)
        say(f"streaming 7 GEMVs ({total / 1e6:.0f} MB, floor {total / 4.2e12 * 1e6:.1f} us): {label} {t * 1e3:.1f} us "
            f"({total / t / 1e9:.2f} TB/s)")


if __name__ == "__main__":
    sys.exit(main())
