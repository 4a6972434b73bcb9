"""GPT-2's layernorm backward alone (fp32 residual stream under bf16 autocast): dx (with the residual
gradient added) from a row pass, dw and db as column sums in the same pass (codegen/row_column.py:
per-program partials, then a finish kernel). Times Inductor's compile of the same function, our
kernel with its shipped candidates (codegen/configs._row_column_configs, tuned) and, with --sweep,
a wider grid of tile rows, warps, rows per program and pipeline stages, each against the bytes'
floor.

    PYTHONPATH=src python bench/layernorm_bwd_gpu.py [--tokens 8192 --features 768] [--sweep] [--profile]

Text to stdout and $OUT/layernorm_bwd.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import re
import sys
from contextlib import redirect_stderr
from typing import Any

import torch

import fusegraph as fg
from fusegraph.codegen import configs
from fusegraph.perf.timing import device_time
from fusegraph.settings import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_syncs_gpu import emit


def reference(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = x.shape[1]
    dyf = dy.float()
    xhat = (x - mean) * rstd
    gw = dyf * w
    a = gw.sum(1, keepdim=True) / d
    b = (gw * xhat).sum(1, keepdim=True) / d
    return (gw - a - xhat * b) * rstd + res, (dyf * xhat).sum(0), dyf.sum(0)


def graph(n: int, d: int) -> fg.Graph:
    g = fg.Graph("layernorm_bwd")
    x = g.tensor((n, d), "float32", "x")
    dy = g.cast(g.tensor((n, d), "bfloat16", "dy"), "float32")
    w = g.tensor((d,), "float32", "w")
    mean, rstd = g.tensor((n, 1), "float32", "mean"), g.tensor((n, 1), "float32", "rstd")
    res = g.tensor((n, d), "float32", "res")
    xhat = g.mul(g.sub(x, mean), rstd)
    gw = g.mul(dy, w)
    a = g.mul(g.sum(gw, dim=1, keepdim=True), 1.0 / d)
    b = g.mul(g.sum(g.mul(gw, xhat), dim=1, keepdim=True), 1.0 / d)
    g.add(g.mul(g.sub(g.sub(gw, a), g.mul(xhat, b)), rstd), res).set_output()
    g.sum(g.mul(dy, xhat), 0).set_output()
    g.sum(dy, 0).set_output()
    return g


def sweep(rows: int, cols: int, extent: int | None = None) -> list[dict[str, Any]]:
    """Tile rows x warps x rows per program x stages (the shipped list's form)."""
    whole = configs.next_pow2(cols)
    out = []
    for tile_rows, warps, rpp, stages in itertools.product((1, 2, 4, 8), (2, 4, 8), (4, 8, 16, 32, 64), (1, 2, 3)):
        if tile_rows > rpp or tile_rows * whole > 8192:
            continue
        splits = -(-rows // rpp)
        out.append({"ROWS": tile_rows, "BLOCK_C": whole, "RPP": rpp, "SPLITS": splits,
                    "SPLITS_P2": configs.next_pow2(splits), "FROWS": min(configs.next_pow2(extent or cols), 32),
                    "STAGES": stages, "num_warps": warps})
    return out


SHIPPED = configs._row_column_configs


def profile_kernels(plan: Any, args_: tuple[torch.Tensor, ...], say: Any, calls: int = 20) -> None:
    """Each CUDA kernel's mean duration over `calls` back-to-back calls of the plan (torch.profiler):
    the row pass and its finish kernel apart."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        plan(*args_)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            plan(*args_)
        torch.cuda.synchronize()
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if ev.device_time_total > 0 and ev.count >= calls:
            say(f"      {ev.key[:70]:70s} {ev.device_time_total / ev.count:8.2f} us x{ev.count // calls} a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--features", type=int, default=768)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel durations (row pass, finish) under torch.profiler; finish tiles FROWS 4-16")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    def say(text: str) -> None:
        emit(text, "layernorm_bwd.txt")

    n, d = args.tokens, args.features
    x = torch.randn(n, d, device="cuda")
    dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d, device="cuda")
    mean, rstd = x.mean(1, keepdim=True), torch.rsqrt(x.var(1, keepdim=True) + 1e-5)
    res = torch.randn(n, d, device="cuda")
    args_ = (x, dy, w, mean, rstd, res)
    moved = n * d * (4 + 2 + 4 + 4)      # x, dy, the residual gradient read; dx written
    floor_ms = moved / 4.8e12 * 1e3
    say(f"# layernorm backward [{n}, {d}] (fp32 x, bf16 dy, fp32 residual gradient in, fp32 dx out, dw/db sums): "
        f"{moved / 1e6:.0f} MB moved, floor {floor_ms:.4f} ms at 4.8 TB/s")
    ref = reference(*args_)

    def row(name: str, fn: Any) -> float:
        ms = device_time(fn, calls=50, repeats=5).ms
        got = fn()
        errs = [float((g.float() - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True)]
        say(f"{name:60s} {ms:8.4f} ms  {100 * floor_ms / ms:4.0f}% of floor  rel err "
            + ", ".join(f"{e:.1e}" for e in errs))
        return ms

    inductor = torch.compile(reference)
    row("torch.compile (Inductor)", lambda: inductor(*args_))

    def tuned(label: str) -> None:
        log = io.StringIO()
        with override(tune="full", debug=2), redirect_stderr(log):
            plan = graph(n, d).build(device="cuda")
        timed = []
        for ln in log.getvalue().splitlines():
            m = re.search(r"(Config\(.*?\)).*?([0-9.]+) ms", ln)
            if m:
                timed.append((float(m.group(2)), m.group(1)))
        timed.sort()
        say(f"{label}: {len(timed)} configs timed by the autotuner (alone, after an L2 flush), fastest first:")
        for ms, cfg in timed[: args.top]:
            say(f"   {ms:8.4f} ms  {100 * floor_ms / ms:4.0f}%  {cfg}")
        row(f"fusegraph {label}, chosen {[k.config for k in plan.kernels if k.backend == 'triton'][:1]}",
            lambda: plan(*args_))

    tuned("shipped candidates")
    if args.profile:
        profile_kernels(graph(n, d).build(device="cuda"), args_, say)
        for frows in (4, 8, 16):
            configs._row_column_configs = lambda rows, cols, extent=None, f=frows: [   # type: ignore[assignment]
                {**c, "FROWS": min(c["FROWS"], f)} for c in SHIPPED(rows, cols, extent)]
            with override(tune="full"):
                plan = graph(n, d).build(device="cuda")
            say(f"FROWS <= {frows}: chosen {[k.config for k in plan.kernels if k.backend == 'triton'][:1]}")
            row(f"fusegraph FROWS <= {frows}", lambda plan=plan: plan(*args_))
            profile_kernels(plan, args_, say)
        configs._row_column_configs = SHIPPED   # type: ignore[assignment]
    if args.sweep:
        configs._row_column_configs = sweep   # type: ignore[assignment]
        tuned("sweep")


if __name__ == "__main__":
    sys.exit(main())
