"""Where the time of issue 5's target workloads goes, CUDA kernel by kernel, fusegraph beside torch.compile:
the GPT-2-124M training step, the Llama decode step and ResNet-50 inference (bench/targets_gpu.py builds them).

    PYTHONPATH=src python bench/profile_targets_gpu.py --only gpt2_train,llama_decode,resnet50

For each workload and implementation: device time of N back-to-back calls (CUDA events), the number of CUDA
kernels one call launches, and the kernels grouped by name with their total time (torch.profiler, CUDA
activity), sorted by time; for fusegraph also the plan's kernel list per graph (fwd/bwd). Text to stdout and
$OUT/profile_targets.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T
from llama_blocks import DECODE_SIZE, decode_setup


def kernel_table(fn: Callable[[], Any], rows: int) -> str:
    """One profiled call: kernels grouped by name, total and count, longest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            groups.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                  else ev.cuda_time_total)
    total = sum(sum(v) for v in groups.values())
    count = sum(len(v) for v in groups.values())
    lines = [f"   {count} kernels/copies, {total / 1e3:.3f} ms summed"]
    for name, times in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"   {sum(times) / 1e3:8.3f} ms {len(times):4d}x  {name[:150]}")
    return "\n".join(lines)


def plan_kernels(fn: Any) -> str:
    report = getattr(fn, "fusegraph_report", None) or getattr(getattr(fn, "run", None), "fusegraph_report", None)
    if report is None:
        return "   (no fusegraph report)"
    lines = []
    for graph in report.graphs:
        kernels = [k for p in graph.partitions if p.status == "fusegraph" for k in p.kernel_ops]
        eager = [p for p in graph.partitions if p.status != "fusegraph"]
        lines.append(f"   graph {graph.kind}: {len(kernels)} plan kernels, {len(eager)} eager partitions, "
                     f"fallbacks {dict(graph.fallbacks)}")
        for k in kernels:
            lines.append(f"     {k}")
    return "\n".join(lines)


def live_plans(fn: Any) -> list[tuple[str, str, Any]]:
    """(graph kind, partition name, Plan) of each fusegraph partition of the call whose Plan is alive."""
    report = getattr(fn, "fusegraph_report", None) or getattr(getattr(fn, "run", None), "fusegraph_report", None)
    if report is None:
        return []
    return [(graph.kind, part.name, part.plan) for graph in report.graphs for part in graph.partitions
            if part.plan is not None]


def plan_details(fn: Any, kinds: tuple[str, ...]) -> str:
    """Per plan kernel of the given kinds (and each split column reduction or row-tiled pointwise
    kernel): backend, chosen config, how it was tuned, notes."""
    lines = []
    for graph_kind, _, plan in live_plans(fn):
        for k in plan.kernels:
            if not (k.kind in kinds or "SPLITS" in (k.config or {}) or "ROW_TILED" in (k.config or {})):
                continue
            config = {a: v for a, v in (k.config or {}).items() if a in (
                "VARIANT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "candidate", "backend", "USE_TMA", "ROWS",
                "BLOCK_C", "CHUNK", "SPLITS", "STAGES", "num_warps", "BLOCK", "ROW_TILED")}
            attrs = {a: v for a, v in k.nodes[0].attrs.items() if a in ("causal", "has_lse", "return_lse")} \
                if k.kind == "attention" else ""
            masked = f" inputs={len(k.nodes[0].inputs)}" if k.kind == "attention" else \
                " in=" + " ".join(f"{list(i.shape)}/{list(i.spec.memory_strides)}" for i in k.nodes[0].inputs)
            lines.append(f"   [{graph_kind}] {k.name} {k.kind}/{k.backend} {config} {attrs}{masked} "
                         f"tuning={k.tuning} {k.note or ''}".rstrip())
    return "\n".join(lines)


def range_table(fn: Callable[[], Any], rows: int) -> str:
    """One call's device work grouped by the innermost 'fg:' torch.profiler range (plans built with
    settings.profile_ranges) around the CPU op it is attributed to, and by device kernel name, longest
    total first. The profiler attributes a kernel to the ATen op active at its launch: copies, clones
    and torch library calls inside a plan kernel's or glue step's range are named by it, but Triton and
    cuDNN frontend launches (no ATen op of their own) land on the enclosing op, e.g. AOTAutograd's
    CompiledFunction ("outside fusegraph ... via CompiledFunction"). Work under a partition's range
    but in no plan kernel or glue step is "partition, other" (a captured CUDA graph's replay code)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[tuple[str, str], list[float]] = {}
    for ev in prof.events():
        if not ev.kernels:
            continue
        owner, node = "outside fusegraph", ev
        while node is not None:
            if node.name.startswith("fg:"):
                kind, _, name = node.name[3:].partition(":")
                # a plan kernel's range by kind (its name without the fg_k<N>_ prefix), a glue step by name
                owner = (f"{kind}:{name.split('_', 2)[-1]}" if kind not in ("partition", "glue")
                         else f"glue: {name}" if kind == "glue" else "partition, other")
                break
            node = node.cpu_parent
        via = "" if ev.name.startswith("fg:") else f" via {ev.name}"
        for kernel in ev.kernels:
            entry = groups.setdefault((owner, kernel.name[:70] + via[:40]), [0, 0.0])
            entry[0] += 1
            entry[1] += kernel.duration
    lines = [f"   device work by issuing plan kernel: {sum(v[0] for v in groups.values())} launches"]
    for (owner, name), (count, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"   {us / 1e3:8.3f} ms {count:5d}x  {owner[:70]:70s} {name}")
    return "\n".join(lines)


RANGES = False   # --ranges: also group device work by the fusegraph range it was issued in (range_table)
EXPLAIN = 0      # --explain N: each plan's N kernels furthest above their roofline floor (explain_table)


def explain_table(fn: Any, top: int) -> str:
    """Per fusegraph plan of the call (forward, backward, ...), each kernel timed alone on random
    inputs (perf/explain.analyze_plan: what plan.explain() measures) against its roofline floor; the
    `top` kernels with the most time above their floor, and the plan's totals."""
    from fusegraph.perf.explain import analyze_plan

    lines = []
    for graph_kind, name, plan in live_plans(fn):
        rep = analyze_plan(plan, measure=True)
        measured = rep.total_measured_s or 0.0
        lines.append(f"   [{graph_kind}] {name}: {len(rep.rows)} kernels, {measured * 1e3:.3f} ms timed one "
                     f"by one, floor {rep.total_floor_s * 1e3:.3f} ms")
        rows = sorted((r for r in rep.rows if r.measured_s is not None), key=lambda r: -(r.above_floor_s or 0.0))
        for r in rows[:top]:
            ops = "; ".join(r.ops)[:110]
            lines.append(f"     {r.name[:34]:34s} {r.kind + '/' + r.backend:22s} {(r.measured_s or 0) * 1e3:7.3f} ms "
                         f"floor {r.floor.seconds * 1e3:7.3f} ({r.pct_of_floor or 0:3.0f}%) "
                         f"{(r.achieved_bandwidth or 0) / 1e9:6.0f} GB/s  {ops}")
    return "\n".join(lines) or "   (no fusegraph plan alive)"


def measure(name: str, fn: Callable[[], Any], rows: int, with_plan: bool,
            detail_kinds: tuple[str, ...] = ("matmul", "attention", "convolution")) -> None:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    ms = device_time(fn, calls=20, repeats=3, graph=False).ms
    print(f"\n-- {name}: device {ms:.3f} ms per call (back-to-back); first call (compile) {first_s:.1f} s",
          flush=True)
    print(kernel_table(fn, rows), flush=True)
    if with_plan and RANGES:
        print(range_table(fn, rows), flush=True)
    if with_plan:
        print(plan_kernels(fn), flush=True)
        print(plan_details(fn, detail_kinds), flush=True)
    if with_plan and EXPLAIN:
        print(explain_table(fn, EXPLAIN), flush=True)


SKIP: set[str] = set()   # --skip: implementations not run


def gpt2_train(rows: int, batch: int) -> None:
    torch.manual_seed(0)
    base = T.LMWithLoss(T.gpt2("full")).cuda()
    ids = torch.randint(0, 50257, (batch, 1024), device="cuda")
    targets = torch.randint(0, 50257, (batch, 1024), device="cuda")
    print(f"\n== GPT-2 train step batch {batch}x1024, autocast bf16, fused AdamW")
    impls: list[tuple[str, Callable[[Any], Any]]] = [
        ("torch.compile", torch.compile), ("fusegraph", fg.compile),
        ("fusegraph reduce-overhead", lambda m: fg.compile(m, mode="reduce-overhead"))]
    for name, compile_fn in impls:
        if SKIP and name in SKIP:
            continue
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        step = T.TrainStep(model, compile_fn(model), ids, targets, torch.bfloat16)
        measure(name, step, rows, name == "fusegraph")
        del step, model
        torch.cuda.empty_cache()


def llama_decode(rows: int) -> None:
    base, x, pos = decode_setup()
    print(f"\n== Llama decode step {DECODE_SIZE}, bf16")
    impls: list[tuple[str, Callable[[Any], Any]]] = [
        ("torch.compile reduce-overhead", lambda m: torch.compile(m, mode="reduce-overhead")),
        ("torch.compile", torch.compile),
        ("fusegraph (no CUDA graph)", lambda m: fg.compile(m, options={"cuda_graphs": False})),
        ("fusegraph reduce-overhead", lambda m: fg.compile(m, mode="reduce-overhead"))]
    for name, compile_fn in impls:
        torch._dynamo.reset()
        block = copy.deepcopy(base).to(torch.bfloat16)
        step = T.DecodeStep(block, compile_fn(block), x, pos)
        measure(name, step, rows, name.startswith("fusegraph"))


def resnet50(rows: int, batch: int) -> None:
    base = T.resnet50("full").eval().cuda()
    for fmt_name, fmt in (("channels_last", torch.channels_last), ("NCHW", torch.contiguous_format)):
        if fmt_name in SKIP:
            continue
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt)
        print(f"\n== ResNet-50 inference batch {batch} bf16 {fmt_name}")
        for name, compile_fn in (("torch.compile", torch.compile), ("fusegraph", fg.compile)):
            if name in SKIP:
                continue
            torch._dynamo.reset()
            model = copy.deepcopy(base).to(dtype=torch.bfloat16, memory_format=fmt)  # type: ignore[call-overload]
            compiled = compile_fn(model)

            def call(compiled: Any = compiled, x: torch.Tensor = x) -> Any:
                with torch.no_grad():
                    return compiled(x)
            call.fusegraph_report = getattr(compiled, "fusegraph_report", None)  # type: ignore[attr-defined]
            measure(name, call, rows, name == "fusegraph")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="gpt2_train,llama_decode,resnet50")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--skip", default="", help="comma-separated implementation names not to run, "
                                                   "e.g. 'fusegraph reduce-overhead', or ResNet's 'NCHW'")
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--resnet-batch", type=int, default=128)
    parser.add_argument("--ranges", action="store_true",
                        help="build plans with profile ranges (settings.profile_ranges) and group one fusegraph "
                             "call's device work by the range it was issued in (copies, ATen calls: range_table)")
    parser.add_argument("--explain", type=int, default=0, metavar="N",
                        help="time each fusegraph plan kernel alone against its roofline floor and list the N "
                             "furthest above it per plan (explain_table)")
    args = parser.parse_args()
    global RANGES, EXPLAIN
    RANGES = args.ranges
    EXPLAIN = args.explain
    if RANGES:
        os.environ["FUSEGRAPH_PROFILE_RANGES"] = "1"
    SKIP.update(name.strip() for name in args.skip.split(",") if name.strip())
    T.S.device = "cuda"
    from zoo_models import ensure_torchvision_importable
    ensure_torchvision_importable()
    out_file = open(os.path.join(os.environ["OUT"], "profile_targets.txt"), "a") if os.environ.get("OUT") else None  # noqa: SIM115
    with redirect_stdout(_Tee(sys.stdout, out_file)):   # written as it goes: a timeout keeps what was measured
        for group in args.only.split(","):
            try:
                if group == "gpt2_train":
                    gpt2_train(args.rows, args.gpt2_batch)
                elif group == "llama_decode":
                    llama_decode(args.rows)
                elif group == "resnet50":
                    resnet50(args.rows, args.resnet_batch)
                else:
                    raise SystemExit(f"unknown group {group!r}")
            except Exception as exc:  # report and go on with the next group
                import traceback
                print(f"!! {group} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")


class _Tee(io.TextIOBase):
    """stdout that also appends to a file, flushing both on every write."""

    def __init__(self, stream: Any, file: Any) -> None:
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        for target in (self.stream, self.file):
            if target is not None:
                target.write(text)
                target.flush()
        return len(text)

if __name__ == "__main__":
    main()
