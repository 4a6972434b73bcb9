"""Our generated GEMM candidates of each kind vs cuBLAS, per shape, on the GPU (H200).

For every case the graph is built and partitioned as fusegraph would, the GEMM's MatmulGroup (the
matmul and its claimed epilogue) is generated, and the candidates the autotuner would be offered
(backends/matmul_kernel._gemm_candidates: tiled, persistent, stream-K, split-K) are compiled in parallel,
checked against the cuBLAS candidate's result and timed, next to cuBLAS (torch.matmul + the
epilogue as our generated pointwise kernel, exactly the library candidate) and a bare
torch.matmul / addmm as the library floor. Prints TFLOP/s per candidate, the best of each kind and
the winner; JSON in $OUT (else bench/results/).

Cases: GPT-2-124M's training-step GEMMs under bf16 autocast (8192 tokens: qkv, attention projection +
residual, fc, MLP projection + residual, the LM head), gelu_mlp's two GEMMs (bf16, x 8192x4096,
W1 4096x16384 + b -> gelu; h 8192x16384 @ W2 + b),
8192^3 bf16, decode shapes (M = 1, 8, 32; K = 4096; N = 4096, 11008, 14336; bf16, no epilogue),
and the fp8 quantize epilogue (bf16 8192x4096 @ 4096x4096, then scale, saturate, cast to e4m3 and a
per-tensor amax; the amax is fused when the pipeline claims it).

    PYTHONPATH=src python bench/gemm_tune_gpu.py [--only gpt2,mlp1,mlp2,square,decode,fp8] [--max-s 240]
        [--streamk-sweep]   # also stream-K on every persistent config, with other run lengths
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/gemm_tune_gpu.py --cpu-smoke   # tiny shapes, fp16, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from out_files import write_report

import fusegraph as fg
from fusegraph.backends import cublas
from fusegraph.backends.matmul_kernel import GemmLaunch, _gemm_candidates, _LazyEpilogue, check_same, matmul_group_cost
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.matmul import generate_gemm
from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override
from fusegraph.tune import bench_ms
from fusegraph.tune.precompile import compile_in_parallel

Case = Callable[[fg.Graph, str], None]


def mlp1(m: int, k: int, n: int) -> Case:
    def build(g: fg.Graph, dt: str) -> None:
        x, w = g.tensor((m, k), dtype=dt, name="x"), g.tensor((k, n), dtype=dt, name="w1")
        b = g.tensor((n,), dtype=dt, name="b1")
        g.gelu(g.add(g.matmul(x, w), b), approximate="tanh").set_output()
    return build


def linear_bias(m: int, k: int, n: int) -> Case:
    def build(g: fg.Graph, dt: str) -> None:
        x, w = g.tensor((m, k), dtype=dt, name="h"), g.tensor((k, n), dtype=dt, name="w2")
        b = g.tensor((n,), dtype=dt, name="b2")
        g.add(g.matmul(x, w), b).set_output()
    return build


def plain(m: int, k: int, n: int, weight_nk: bool = False) -> Case:
    def build(g: fg.Graph, dt: str) -> None:
        x = g.tensor((m, k), dtype=dt, name="x")
        if weight_nk:  # nn.Linear's weight layout [N, K]
            g.matmul(x, g.tensor((n, k), dtype=dt, name="w"), transpose_b=True).set_output()
        else:
            g.matmul(x, g.tensor((k, n), dtype=dt, name="w")).set_output()
    return build


def autocast_linear(m: int, k: int, n: int, residual: bool = False) -> Case:
    """A linear layer as AOTAutograd traces it under bf16 autocast (GPT-2's Conv1D: addmm): the fp32
    bias cast to 16 bits in the epilogue, and with `residual` the result cast to fp32 and added to
    the fp32 residual stream."""
    def build(g: fg.Graph, dt: str) -> None:
        x, w = g.tensor((m, k), dtype=dt, name="x"), g.tensor((k, n), dtype=dt, name="w")
        y = g.add(g.matmul(x, w), g.cast(g.tensor((n,), dtype="float32", name="b"), dt))
        if residual:
            y = g.add(g.cast(y, "float32"), g.tensor((m, n), dtype="float32", name="r"))
        y.set_output()
    return build


def fp8_quantize(m: int, k: int, n: int, qdtype: str = "float8_e4m3fn") -> Case:
    def build(g: fg.Graph, dt: str) -> None:
        x, w = g.tensor((m, k), dtype=dt, name="x"), g.tensor((k, n), dtype=dt, name="w")
        scale = g.tensor((), dtype="float32", name="scale")
        y = g.matmul(x, w)
        q, _ = g.quantize(y, qdtype, scale=scale)
        q.set_output()
        g.max(g.abs(y)).set_output()
    return build


def cases(smoke: bool) -> dict[str, list[tuple[str, Case, int]]]:
    """group -> [(label, builder, FLOPs of the GEMM)]"""
    if smoke:
        return {"gpt2": [("linear_residual", autocast_linear(32, 32, 48, True), 2 * 32 * 32 * 48)],
                "mlp1": [("mlp1", mlp1(64, 32, 96), 2 * 64 * 32 * 96)],
                "decode": [("decode_m4", plain(4, 1024, 48, weight_nk=True), 2 * 4 * 1024 * 48)],
                "fp8": [("quant_int8", fp8_quantize(32, 32, 48, "int8"), 2 * 32 * 32 * 48)]}
    decode = [(f"decode_m{m}_n{n}", plain(m, 4096, n, weight_nk=True), 2 * m * 4096 * n)
              for m in (1, 8, 32) for n in (4096, 11008, 14336)]
    tokens = 8192   # GPT-2-124M's training step: batch 8 x 1024
    gpt2 = [("gpt2_qkv", autocast_linear(tokens, 768, 2304), 2 * tokens * 768 * 2304),
            ("gpt2_attn_proj_residual", autocast_linear(tokens, 768, 768, True), 2 * tokens * 768 * 768),
            ("gpt2_fc", autocast_linear(tokens, 768, 3072), 2 * tokens * 768 * 3072),
            ("gpt2_mlp_proj_residual", autocast_linear(tokens, 3072, 768, True), 2 * tokens * 3072 * 768),
            ("gpt2_lm_head", plain(tokens, 768, 50257, weight_nk=True), 2 * tokens * 768 * 50257)]
    return {"gpt2": gpt2,
            "mlp1": [("gelu_mlp_gemm1", mlp1(8192, 4096, 16384), 2 * 8192 * 4096 * 16384)],
            "mlp2": [("gelu_mlp_gemm2", linear_bias(8192, 16384, 4096), 2 * 8192 * 16384 * 4096)],
            "square": [("square_8192", plain(8192, 8192, 8192), 2 * 8192 ** 3)],
            "decode": decode,
            "fp8": [("fp8_quantize_epilogue", fp8_quantize(8192, 4096, 4096), 2 * 8192 * 4096 * 4096)]}


def matmul_group(build: Case, dt: str, label: str) -> tuple[MatmulGroup, fg.Graph]:
    g = fg.Graph(name=label, compute_dtype="float32")
    build(g, dt)
    plan = g.build(device="cpu")
    groups = [i for i in claim_epilogues(partition_graph(plan.graph).items, plan.graph) if isinstance(i, MatmulGroup)]
    return groups[0], plan.graph


def inputs(group: MatmulGroup, device: str) -> list[torch.Tensor]:
    out = []
    for n in group.inputs:
        dt = getattr(torch, n.dtype)
        if n.shape == ():
            out.append(torch.tensor(0.05, dtype=dt, device=device))
        else:
            k = n.shape[-2] if len(n.shape) >= 2 and n.name.startswith("w") else (n.shape[-1] if n.shape else 1)
            out.append((torch.randn(n.shape, device=device) / max(1, k) ** 0.5).to(dt))
    return out


STREAMK_SWEEP = False


def streamk_sweep(geo: Any, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """More stream-K candidates than the autotuner gets: every persistent config with the last wave
    shared out, each with runs of the even spread (R x K iterations / programs), of sqrt(K iterations)
    and of twice that, where these differ from the offered candidate."""
    import math

    out: list[dict[str, Any]] = []
    for c in configs:
        if c.get("VARIANT") != "persistent":
            continue
        programs = int(c["NUM_PROGRAMS"])
        tiles = -(-geo.m // c["BLOCK_M"]) * -(-geo.n // c["BLOCK_N"])
        tail = tiles % programs
        if not tail:
            continue
        k_iters = -(-geo.k // c["BLOCK_K"])
        even = -(-tail * k_iters // programs)
        root = math.isqrt(k_iters - 1) + 1
        for run in sorted({even, max(even, root), max(even, 2 * root), max(even, root // 2)}):
            cand = dict(c, VARIANT="streamk", SK_TILES=tail, SK_ITERS=run)
            if cand not in configs and cand not in out:
                out.append(cand)
    return out


def run_case(label: str, build: Case, flops: int, dt: str, device: str) -> dict[str, Any]:
    start = time.perf_counter()
    group, _ = matmul_group(build, dt, label)
    name = f"bench_{label}"
    with override(gemm_streamk=STREAMK_SWEEP):   # the stream-K source, for the sweep's candidates
        gen = generate_gemm(group, name)
    configs = _gemm_candidates(gen, device, group)
    if STREAMK_SWEEP:
        configs = configs + streamk_sweep(gen.geometry, configs)
    fn = load_triton_function(gen.source, gen.name)
    args = inputs(group, device)
    epilogue = None if not group.epilogue_nodes else _LazyEpilogue(group, name, "float32", device, {})
    amax = [_LazyEpilogue(group, name, "float32", device, {}, r, f"amax{k}") for k, r in enumerate(group.reductions)]
    library = cublas.cublas_launch(group, epilogue, amax)
    own = cublas.own_epilogue(group, device) if device.startswith("cuda") else None
    expected = library(args)
    launches = []
    for c in configs:
        try:
            launches.append((c, GemmLaunch(fn, gen, c, device)))
        except Exception as err:
            launches.append((c, err))
    jobs = [j for _, ln in launches if isinstance(ln, GemmLaunch) for j in ln.warmup_jobs(args)]
    compile_errors = [e for e in compile_in_parallel(jobs) if e]
    rows: list[dict[str, Any]] = []
    for c, ln in launches:
        row: dict[str, Any] = {"variant": c.get("VARIANT", "tiled"), "config": c}
        try:
            if not isinstance(ln, GemmLaunch):
                raise ln
            check_same(ln(args), expected, f"{label} {c}")
            ms = bench_ms(lambda ln=ln: ln(args))
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as err:
            row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
    ms = bench_ms(lambda: library(args))
    rows.append({"variant": "cublas+epilogue", "config": {}, "ms": ms, "tflops": flops / ms / 1e9})
    if own is not None:   # cuBLAS computing the epilogue itself (addmm / mm(out_dtype=)): one launch
        own_launch = cublas.cublas_launch(group, epilogue, amax, own)
        check_same(own_launch(args), expected, f"{label} cuBLAS {own.kind} epilogue", True)
        ms = bench_ms(lambda: own_launch(args))
        rows.append({"variant": f"cublas_own_{own.kind}", "config": {}, "ms": ms, "tflops": flops / ms / 1e9})
    a, b = (args[[n.id for n in group.inputs].index(x.id)] for x in group.matmul.inputs)
    mm = group.matmul
    ms = bench_ms(lambda: cublas.torch_matmul(a, b, bool(mm.attrs.get("trans_a")), bool(mm.attrs.get("trans_b"))))
    rows.append({"variant": "cublas_bare_matmul", "config": {}, "ms": ms, "tflops": flops / ms / 1e9})
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "ms" in r and (r["variant"] not in best or r["ms"] < best[r["variant"]]["ms"]):
            best[r["variant"]] = r
    candidates = {k: v for k, v in best.items() if k != "cublas_bare_matmul"}
    winner = min(candidates, key=lambda k: candidates[k]["ms"]) if candidates else None
    cost = matmul_group_cost(group)
    return {"case": label, "ops": [n.op for n in group.nodes], "flops": flops, "bytes": cost.bytes,
            "rows": rows,
            "best": {k: {"ms": v["ms"], "tflops": v["tflops"], "config": v["config"]} for k, v in best.items()},
            "winner": winner, "compile_errors": compile_errors[:5], "seconds": time.perf_counter() - start}


def alternating_rows(timed: Sequence[tuple[str, Callable[[], Any]]], order: Sequence[str], notes: dict[str, str],
                     flops: int, base: Callable[[dict[str, float]], float | None], rounds: int = 5,
                     width: int = 16) -> list[str]:
    """Time each (tag, call) with bench_ms `rounds` times in alternation (drift falls on every call
    alike) and format one row per tag of `order`: median and best microseconds, TFLOP/s, the speed-up
    over `base(medians)`, and the tag's note (a tag that was not timed: its note only)."""
    times: dict[str, list[float]] = {tag: [] for tag, _ in timed}
    for _ in range(rounds):
        for tag, call in timed:
            times[tag].append(bench_ms(call))
    medians = {tag: statistics.median(v) for tag, v in times.items()}
    ref = base(medians)
    rows = []
    for tag in order:
        if tag not in medians:
            rows.append(f"  {tag:<{width}} {notes.get(tag, '')}")
            continue
        med, best = medians[tag], min(times[tag])
        ratio = f"{ref / med:6.3f}x" if ref else ""
        rows.append(f"  {tag:<{width}} median {med * 1e3:8.1f} us (best {best * 1e3:8.1f}) "
                    f"{flops / med / 1e9:6.1f} TFLOP/s {ratio}  {notes.get(tag, '')}")
    return rows


def cases_main(script: str, doc: str, run: Callable[[str, Case, int], list[str]], out_prefix: str,
               default_only: str = "mlp1,mlp2,gpt2") -> int:
    """The command line of a bench that runs `run(label, build, flops)` (-> report lines) over these
    cases (--only groups, --cases labels): prints the lines and writes them to $OUT/<out_prefix>_<time>.txt."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=default_only)
    parser.add_argument("--cases", default="", help="comma-separated case labels (default: all of --only)")
    opts = parser.parse_args()
    start = time.perf_counter()
    lines = [f"# python bench/{script} {' '.join(sys.argv[1:])}; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}"]
    for group_name in opts.only.split(","):
        for label, build, flops in cases(False).get(group_name, []):
            if opts.cases and label not in opts.cases.split(","):
                continue
            try:
                rows = run(label, build, flops)
            except Exception as err:
                rows = [f"{label}: ERROR {type(err).__name__}: {str(err)[:300]}"]
            print("\n".join(rows), flush=True)
            lines += rows
    lines.append(f"total {time.perf_counter() - start:.1f} s")
    print(lines[-1])
    write_report(out_prefix, lines)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="gpt2,mlp1,mlp2,square,decode,fp8")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--max-s", type=float, default=240.0, help="skip remaining cases after this many seconds")
    parser.add_argument("--streamk-sweep", action="store_true",
                        help="also time stream-K on every persistent config, with other run lengths")
    opts = parser.parse_args()
    global STREAMK_SWEEP
    STREAMK_SWEEP = opts.streamk_sweep
    device = "cpu" if opts.cpu_smoke else "cuda"
    dt = "float16" if opts.cpu_smoke else "bfloat16"
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    for group_name in opts.only.split(","):
        for label, build, flops in cases(opts.cpu_smoke).get(group_name, []):
            if time.perf_counter() - t0 > opts.max_s:
                results.append({"case": label, "skipped": "time budget"})
                continue
            try:
                res = run_case(label, build, flops, dt, device)
            except Exception as err:
                res = {"case": label, "error": f"{type(err).__name__}: {str(err)[:400]}"}
            results.append(res)
            _print(res)
            sys.stdout.flush()
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "seconds": round(time.perf_counter() - t0, 1)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"gemm_tune_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1, default=str)
    print(f"total {info['seconds']} s; JSON: {path}")
    return 0


def _print(res: dict[str, Any]) -> None:
    if "error" in res:
        print(f"{res['case']}: ERROR {res['error']}")
        return
    print(f"\n{res['case']}  ops={'+'.join(res['ops'])}  ({res['seconds']:.1f} s)")
    for r in res["rows"]:
        c = r["config"]
        tile = ""
        if c:
            tile = f"{c.get('BLOCK_M')}x{c.get('BLOCK_N')}x{c.get('BLOCK_K')}"
            tile += f" w{c.get('num_warps')} s{c.get('num_stages')}"
            tile += (" tma" if c.get("USE_TMA") else "") + (f" splits={c['SPLITS']}" if "SPLITS" in c else "")
            tile += f" sk={c['SK_TILES']}x{c['SK_ITERS']}" if "SK_TILES" in c else ""
        perf = f"{r['tflops']:8.1f} TFLOP/s {r['ms'] * 1e3:9.1f} us" if "ms" in r else f"ERROR {r['error'][:120]}"
        print(f"  {r['variant']:<20} {tile:<36} {perf}")
    best = ", ".join(f"{k} {v['tflops']:.1f}" for k, v in res["best"].items())
    print(f"  best: {best}  -> winner {res['winner']}")
    if res["compile_errors"]:
        print(f"  compile errors: {res['compile_errors'][:2]}")


if __name__ == "__main__":
    raise SystemExit(main())
