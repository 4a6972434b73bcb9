"""Two GEMM programs an SM against one: does a second resident program hide the epilogue?

Our persistent GEMM (one 128x256 program an SM, 8 warps) runs each tile's epilogue (bias, activation,
the store) on the warps that run its MMAs, so the tensor cores idle meanwhile. gelu_mlp's first GEMM
(K = 4096, a tanh-GELU epilogue on 4096 output tiles) runs ~10% below its second (K = 16384, 1024
tiles) for the same FLOPs. With two programs resident on an SM, one program's epilogue can overlap the
other's main loop, as CUTLASS's ping-pong kernels arrange with two consumer warpgroups. Triton 3.6 has
no warp specialization on Hopper; residency is the tool it has: tiles small enough (shared memory
<= ~113 KB, registers <= 32K a program) that two fit.

For each case (gemm_tune_gpu.py's GEMMs) the forms below are checked against cuBLAS and timed in
alternation for ROUNDS rounds (tune.bench_ms: L2 flushed, median call) beside every tiled and persistent
config the autotuner is offered: the table gives the median over rounds, the best, the ratio to the best
offered config, and per form registers, spills,
shared memory and the programs an SM those allow.

    PYTHONPATH=src python bench/gemm_occupancy_gpu.py [--only mlp1,mlp2,gpt2] [--cases gelu_mlp_gemm1,...]
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_tune_gpu as G

from fusegraph.backends import cublas
from fusegraph.backends.matmul_kernel import GemmLaunch, _gemm_candidates, _LazyEpilogue, check_same
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.matmul import generate_gemm
from fusegraph.tune.precompile import compile_in_parallel

ROUNDS = 5
SMEM_PER_SM = 228 * 1024     # H100/H200: 228 KiB a SM, 227 KiB a block at most
REGS_PER_SM = 65536
# (label, variant, tile M, N, K, warps, stages, TMA, programs an SM; GROUP_M)
FORMS = (
    ("2x 128x128x64 w4 s3", "persistent", 128, 128, 64, 4, 3, False, 2, 8),
    ("2x 128x128x64 w4 s3 g16", "persistent", 128, 128, 64, 4, 3, False, 2, 16),
    ("1x 128x128x64 w4 s4", "persistent", 128, 128, 64, 4, 4, False, 1, 8),
    ("2x 128x128x32 w4 s5", "persistent", 128, 128, 32, 4, 5, False, 2, 8),
    ("2x 128x64x64 w4 s4", "persistent", 128, 64, 64, 4, 4, False, 2, 8),
    ("3x 128x64x64 w4 s3", "persistent", 128, 64, 64, 4, 3, False, 3, 8),
    ("tiled 128x128x64 w4 s3", "tiled", 128, 128, 64, 4, 3, False, 0, 8),
    ("tiled 128x128x64 w4 s3 tma", "tiled", 128, 128, 64, 4, 3, True, 0, 8),
    ("2x 128x128x64 w4 s2 tma", "persistent", 128, 128, 64, 4, 2, True, 2, 8),
)


def _resources(launch: GemmLaunch, args: list[torch.Tensor], warps: int) -> tuple[str, int]:
    """'regs R spills S smem B' and the programs an SM those allow (0 when unknown)."""
    try:
        kernel = launch.warmup_jobs(args)[0]()
        kernel._init_handles()
        smem = int(getattr(kernel.metadata, "shared", 0))
        fit = min(SMEM_PER_SM // max(1, smem + 1024), REGS_PER_SM // max(1, kernel.n_regs * 32 * warps))
        return f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} smem {smem // 1024:3d} KiB -> {fit}/SM", fit
    except Exception as err:  # a diagnosis, not the measurement
        return f"(resources: {type(err).__name__})", 0


def run_case(label: str, build: Any, flops: int) -> list[str]:
    group, _ = G.matmul_group(build, "bfloat16", label)
    name = f"occ_{label}"
    gen = generate_gemm(group, name)
    configs = _gemm_candidates(gen, "cuda", group)
    offered = [c for c in configs if c.get("VARIANT") in ("persistent", "tiled", None)]
    persistent = next((c for c in offered if c.get("VARIANT") == "persistent"), None)
    if persistent is None:
        return [f"{label}: no persistent candidate"]
    sms = int(persistent["NUM_PROGRAMS"])
    forms: list[tuple[str, dict[str, Any], int]] = [
        (f"offered {c.get('VARIANT', 'tiled')[:5]} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} "
         f"s{c['num_stages']}" + (" tma" if c.get("USE_TMA") else ""), c, int(c["num_warps"])) for c in offered]
    for tag, variant, bm, bn, bk, warps, stages, tma, per_sm, group_m in FORMS:
        c = dict(persistent if variant == "persistent" else {}, VARIANT=variant, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages, USE_TMA=tma)
        if per_sm:
            c["NUM_PROGRAMS"] = sms * per_sm
        forms.append((tag, c, warps))
    args = G.inputs(group, "cuda")
    epilogue = None if not group.epilogue_nodes else _LazyEpilogue(group, name, "float32", "cuda", {})
    library = cublas.cublas_launch(group, epilogue, [])
    expected = library(args)
    fn = load_triton_function(gen.source, gen.name)
    launches = [(tag, GemmLaunch(fn, gen, c, "cuda"), warps) for tag, c, warps in forms]
    compile_in_parallel([j for _, ln, _ in launches for j in ln.warmup_jobs(args)])
    rows = [f"{label}: {gen.geometry.m}x{gen.geometry.n}x{gen.geometry.k} ({'+'.join(n.op for n in group.nodes)}), "
            f"{sms} SMs"]
    notes: dict[str, str] = {"cuBLAS + epilogue": "library candidate"}
    timed: list[tuple[str, Any]] = [("cuBLAS + epilogue", lambda: library(args))]
    for tag, launch, warps in launches:
        try:
            check_same(launch(args), expected, f"{label} {tag}", True)
            notes[tag], _ = _resources(launch, args, warps)
            timed.append((tag, lambda launch=launch: launch(args)))
        except Exception as err:
            notes[tag] = f"ERROR {type(err).__name__}: {str(err)[:160]}"
    offered_tags = [t for t, _, _ in launches[:len(offered)]]

    def best_offered(medians: dict[str, float]) -> float | None:
        got = [medians[t] for t in offered_tags if t in medians]
        return min(got) if got else None

    return rows + G.alternating_rows(timed, ["cuBLAS + epilogue", *(t for t, _, _ in launches)], notes, flops,
                                     best_offered, ROUNDS, width=28)


if __name__ == "__main__":
    raise SystemExit(G.cases_main("gemm_occupancy_gpu.py", __doc__, run_case, "gemm_occupancy"))
