"""Stream-K against the plain persistent GEMM.

For each case (gemm_tune_gpu.py's GEMMs: gelu_mlp's two, GPT-2's five) the persistent config the
stream-K candidate is built on (gemm_configs.streamk_configs; the first persistent config with the
even spread where that offers none) is timed as:
  persistent   the persistent kernel;
  sk0          the stream-K kernel with SK_TILES = 0: every tile a whole one, the stream-K code compiled
               in but never run (what its presence costs the tile loop);
  sk           the stream-K kernel as offered.
Each is checked against cuBLAS, then all are timed in alternation for ROUNDS rounds (tune.bench_ms
each: L2 flushed, median call); the table gives the median over rounds, the best, the speed-up over
the persistent kernel, registers and spills per thread, and TTGIR op counts (TMA copies, wgmma).
The twenty-fifth session also timed other code forms of the stream-K part (bench/RESULTS.md).

    PYTHONPATH=src python bench/streamk_gpu.py [--only mlp1,mlp2,gpt2] [--cases gpt2_qkv,...]
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_tune_gpu as G

from fusegraph.backends import cublas
from fusegraph.backends.matmul_kernel import GemmLaunch, _gemm_candidates, _LazyEpilogue, check_same
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.matmul import HEADER, _GemmWriter, generate_gemm
from fusegraph.settings import override

ROUNDS = 5


def _regs(launch: GemmLaunch, args: list[torch.Tensor]) -> str:
    try:
        kernel = launch.warmup_jobs(args)[0]()
        kernel._init_handles()
        ttgir = str(kernel.asm.get("ttgir", ""))
        counts = {k: ttgir.count(k) for k in ("async_tma_copy_global_to_local", "warp_group_dot ",
                                              "isAsync = true", "scf.for", "scf.while")}
        return f"regs {kernel.n_regs:3d} spills {kernel.n_spills:4d}  ttgir {counts}"
    except Exception as err:  # the numbers are a diagnosis, not the measurement
        return f"(regs: {type(err).__name__})"


def _streamk_source(group: Any, name: str) -> tuple[tuple[str, ...], str]:
    kname = f"{name}_streamk"
    return (kname,), HEADER + _GemmWriter(group, kname).write_persistent(streamk=True)


def run_case(label: str, build: Any, flops: int) -> list[str]:
    group, _ = G.matmul_group(build, "bfloat16", label)
    name = f"sk_{label}"
    with override(gemm_streamk=True):   # the stream-K source and candidate as the autotuner would get them
        gen = generate_gemm(group, name)
        configs = _gemm_candidates(gen, "cuda", group)
    persistent = next((c for c in configs if c.get("VARIANT") == "persistent"), None)
    if persistent is None:
        return [f"{label}: no persistent candidate"]
    offered = next((c for c in configs if c.get("VARIANT") == "streamk"), None)
    if offered is not None:   # the persistent config it is built on
        persistent = {k: v for k, v in offered.items() if k not in ("SK_TILES", "SK_ITERS")}
        persistent["VARIANT"] = "persistent"
    programs = int(persistent["NUM_PROGRAMS"])
    tiles = -(-gen.geometry.m // persistent["BLOCK_M"]) * -(-gen.geometry.n // persistent["BLOCK_N"])
    k_iters = -(-gen.geometry.k // persistent["BLOCK_K"])
    tail = tiles % programs
    sk = offered or dict(persistent, VARIANT="streamk", SK_TILES=tail,
                         SK_ITERS=max(1, -(-tail * k_iters // programs)))
    args = G.inputs(group, "cuda")
    epilogue = None if not group.epilogue_nodes else _LazyEpilogue(group, name, "float32", "cuda", {})
    expected = cublas.cublas_launch(group, epilogue, [])(args)
    fn = load_triton_function(gen.source, gen.name)
    rows = [f"{label}: {gen.geometry.m}x{gen.geometry.n}x{gen.geometry.k}, {tiles} tiles of "
            f"{persistent['BLOCK_M']}x{persistent['BLOCK_N']} over {programs} programs, {k_iters} K iterations; "
            f"stream-K {sk['SK_TILES']} tiles in runs of {sk['SK_ITERS']}" + ("" if offered else " (not offered)")]

    sk_gen = dataclasses.replace(gen, variants={**gen.variants,
                                                "streamk": gen.variants.get("streamk") or _streamk_source(group, name)})
    launches: list[tuple[str, GemmLaunch]] = [
        ("persistent", GemmLaunch(fn, gen, persistent, "cuda")),
        ("sk0", GemmLaunch(fn, sk_gen, dict(sk, SK_TILES=0, SK_ITERS=1), "cuda")),
        ("sk", GemmLaunch(fn, sk_gen, sk, "cuda"))]
    notes: dict[str, str] = {}
    timed = []
    for tag, launch in launches:
        try:
            check_same(launch(args), expected, f"{label} {tag}", True)
            notes[tag] = _regs(launch, args)
            timed.append((tag, lambda launch=launch: launch(args)))
        except Exception as err:
            notes[tag] = f"ERROR {type(err).__name__}: {str(err)[:200]}"
    return rows + G.alternating_rows(timed, [tag for tag, _ in launches], notes, flops,
                                     lambda medians: medians.get("persistent"), ROUNDS)


if __name__ == "__main__":
    raise SystemExit(G.cases_main("streamk_gpu.py", __doc__, run_case, "streamk"))
