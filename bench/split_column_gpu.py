"""GPT-2's tanh-GELU backward with its bias gradient, alone: a pointwise value stored for every
element (dh, bf16) whose column sums (the bias gradient, fp32) are reduced in the same pass (a split
column reduction with per-element stores: codegen/column_split.py). Times, against the bytes' floor
and torch.compile (Inductor) of the same function: the pointwise kernel alone (dh only, its heuristic
config and tuned), the column sum of dh alone (every config of codegen/configs.SPLIT_TILES), the fused
kernel (every config of SPLIT_STORE_TILES; --sweep: wider lists for both, pipeline stages included);
then a vocabulary-wide log-sum-exp (the cross-entropy forward's row statistic), its candidates timed.

    PYTHONPATH=src python bench/split_column_gpu.py [--tokens 8192 --features 3072] [--sweep] [--wide]

Text to stdout and $OUT/split_column.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import math
import os
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

C = math.sqrt(2.0 / math.pi)
# (kept, reduced, warps, tiles a program, pipeline stages): codegen/configs.SPLIT_STORE_TILES' form
SWEEP = tuple((k, r, w, t, st) for k, r, w, t in (
    (64, 32, 4, 1), (64, 32, 4, 2), (64, 32, 4, 4), (32, 32, 4, 2), (64, 16, 4, 4), (64, 16, 4, 2), (64, 8, 2, 8),
    (64, 64, 4, 2), (128, 16, 4, 4), (32, 32, 2, 4), (64, 16, 2, 4), (128, 32, 8, 2), (64, 32, 8, 2))
    for st in ((1, 2, 3) if t > 1 else (1,)))
# wide tiles: a whole 512-2048-byte run of each token's features a tile (as the pointwise kernel reads it),
# few tokens a tile, many tiles a program; the shipped best (64, 8, 2, 8, 3) for comparison
WIDE = ((64, 8, 2, 8, 3), *((k, r, w, t, st) for k, r, w, t in (
    (256, 8, 4, 4), (256, 8, 4, 8), (512, 4, 4, 8), (512, 4, 8, 8), (512, 8, 8, 4), (1024, 2, 8, 16),
    (1024, 4, 8, 8), (1024, 2, 4, 16), (1024, 1, 4, 32), (256, 16, 8, 4)) for st in (2, 3)))
# the column sum alone (partials only): (kept, reduced, warps, stages), configs.SPLIT_TILES' form
SUM_SWEEP = tuple((k, r, w, st) for k, r, w in ((64, 64, 4), (32, 128, 4), (128, 32, 8), (64, 32, 4), (32, 64, 4),
                                               (64, 64, 8), (128, 64, 8))
                  for st in (1, 2, 3))


def gelu_backward(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d/dh of 0.5 h (1 + tanh(c (h + 0.044715 h^3))) times dy, as autograd writes it (bf16 ops)."""
    t = torch.tanh(C * (h + 0.044715 * h * h * h))
    return 0.5 * dy * (1.0 + t) + 0.5 * h * dy * (1.0 - t * t) * C * (1.0 + 3 * 0.044715 * h * h)


def with_bias_grad(dy: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh = gelu_backward(dy, h)
    return dh, dh.float().sum(0)


def graph(tokens: int, features: int, bias: bool) -> fg.Graph:
    g = fg.Graph("gelu_bwd")
    dy, h = g.tensor((tokens, features), "bfloat16", "dy"), g.tensor((tokens, features), "bfloat16", "h")
    t = g.tanh(g.mul(g.add(h, g.mul(g.mul(g.mul(h, h), h), 0.044715)), C))
    a = g.mul(g.mul(dy, 0.5), g.add(t, 1.0))
    b = g.mul(g.mul(g.mul(g.mul(h, 0.5), dy), g.sub(1.0, g.mul(t, t))),
              g.mul(g.add(g.mul(g.mul(h, h), 3 * 0.044715), 1.0), C))
    dh = g.add(a, b)
    dh.set_output()
    if bias:
        g.sum(g.cast(dh, "float32"), 0).set_output()
    return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--sweep", action="store_true", help="time the wider tile sweep, not only the shipped tiles")
    parser.add_argument("--wide", action="store_true", help="the fused kernel's tiles: wide feature runs (WIDE)")
    parser.add_argument("--no-logsumexp", action="store_true", help="skip the log-sum-exp part")
    args = parser.parse_args()

    def say(text: str) -> None:
        emit(text, "split_column.txt")

    n, f = args.tokens, args.features
    dy = torch.randn(n, f, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(n, f, device="cuda", dtype=torch.bfloat16)
    moved = 3 * n * f * 2          # dy, h read; dh written (the bias gradient is n/f times smaller)
    floor_ms = moved / 4.8e12 * 1e3
    say(f"# tanh-GELU backward + bias gradient, [{n}, {f}] bf16: {moved / 1e6:.0f} MB moved, floor {floor_ms:.4f} ms "
        f"at 4.8 TB/s")
    ref_dh, ref_db = with_bias_grad(dy.float(), h.float())

    def row(name: str, fn: Any, check: bool = True) -> float:
        ms = device_time(fn, calls=50, repeats=5).ms
        err = ""
        if check:
            got = fn()
            got = got if isinstance(got, (tuple, list)) else (got,)
            errs = [float((x.float() - r).norm() / r.norm()) for x, r in zip(got, (ref_dh, ref_db), strict=False)]
            err = "  rel err " + ", ".join(f"{e:.1e}" for e in errs)
        say(f"{name:44s} {ms:8.4f} ms  {moved / ms / 1e6:6.0f} GB/s  {100 * floor_ms / ms:4.0f}% of floor{err}")
        return ms

    inductor = torch.compile(with_bias_grad)
    row("torch.compile (Inductor): dh + bias grad", lambda: inductor(dy, h))
    inductor_pw = torch.compile(gelu_backward)
    row("torch.compile (Inductor): dh only", lambda: inductor_pw(dy, h))
    pw = graph(n, f, bias=False).build(device="cuda")
    row(f"fusegraph dh only ({pw.kernels[0].config})", lambda: pw(dy, h))
    if args.sweep:
        configs.SPLIT_STORE_TILES, configs.SPLIT_TILES = SWEEP, SUM_SWEEP
    if args.wide:
        configs.SPLIT_STORE_TILES = WIDE

    def tuned(g: fg.Graph) -> Any:
        log = io.StringIO()
        with override(tune="full", debug=2), redirect_stderr(log):
            plan = g.build(device="cuda")
        lines = [ln for ln in log.getvalue().splitlines() if "Config(" in ln and " ms" in ln]
        say(f"tile configs timed by the autotuner (each alone, after an L2 flush), {len(lines)}:")
        for ln in lines:
            say("   " + ln.strip())
        return plan

    pw_tuned = tuned(graph(n, f, bias=False))
    row(f"fusegraph dh only, tune=full ({pw_tuned.kernels[0].config})", lambda: pw_tuned(dy, h))

    g = fg.Graph("bias_grad")
    g.sum(g.cast(g.tensor((n, f), "bfloat16", "dh"), "float32"), 0).set_output()
    colsum = tuned(g)
    dh = pw(dy, h)
    col_ms = device_time(lambda: colsum(dh), calls=50, repeats=5).ms
    say(f"fusegraph column sum of dh alone ({[k.config for k in colsum.kernels]}): {col_ms:.4f} ms; "
        f"with dh's kernel, two kernels: {col_ms + device_time(lambda: pw(dy, h), calls=50, repeats=5).ms:.4f} ms")

    plan = tuned(graph(n, f, bias=True))
    kernels = [k for k in plan.kernels if k.backend == "triton"]
    say(f"fusegraph plan: {len(kernels)} kernel(s), chose {[k.config for k in kernels]}")
    row("fusegraph dh + bias grad (partials + finish)", lambda: plan(dy, h))

    if args.no_logsumexp:
        return
    # the cross-entropy forward's row statistic: log-sum-exp over a vocabulary-wide row (looped, online softmax)
    vocab = 50257
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    g = fg.Graph("logsumexp")
    x = g.cast(g.tensor((n, vocab), "bfloat16", "logits"), "float32")
    m = g.max(x, dim=1, keepdim=True)
    g.add(g.log(g.sum(g.exp(g.sub(x, m)), dim=1, keepdim=True)), m).set_output()
    lse = tuned(g)
    ms = device_time(lambda: lse(logits), calls=20, repeats=5).ms
    lse_floor = n * vocab * 2 / 4.8e12 * 1e3
    ref = torch.logsumexp(logits.float(), dim=1, keepdim=True)
    err = float((lse(logits) - ref).norm() / ref.norm())
    say(f"fusegraph log-sum-exp [{n}, {vocab}] bf16 ({[k.config for k in lse.kernels]}): {ms:.4f} ms, floor "
        f"{lse_floor:.4f} ({100 * lse_floor / ms:.0f}%), rel err {err:.1e}")
    torch_lse = torch.compile(lambda t: torch.logsumexp(t.float(), dim=1, keepdim=True))
    torch_ms = device_time(lambda: torch_lse(logits), calls=20, repeats=5).ms
    say(f"torch.compile (Inductor) log-sum-exp: {torch_ms:.4f} ms")


if __name__ == "__main__":
    sys.exit(main())
