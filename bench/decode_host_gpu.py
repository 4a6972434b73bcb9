"""The Llama decode step (bench/targets_gpu.py's llama_decode, b1, KV 2048, bf16) under fusegraph
reduce-overhead and torch.compile reduce-overhead: where one call's latency goes.

For each: back-to-back device time, one call's latency (CUDA events, GPU idle before it), the host time
of one call (perf_counter from the call to its return, GPU idle before it: everything the host does
before and after launching the graph), the CUDA activity of one call, and (fusegraph) a cProfile of 20
calls by own time and the plan's explain().

    PYTHONPATH=src python bench/decode_host_gpu.py [--tag NAME] [--impls fusegraph,torch.compile]

Output to stdout and $OUT/decode_host_<tag>.txt.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import call_latency, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T
from host_syncs_gpu import emit, host_profile
from llama_blocks import decode_setup
from resnet_host_gpu import cuda_activity


def host_time_us(call: Callable[[], Any], calls: int = 50) -> tuple[float, float]:
    """(median, min) microseconds from a call to its return, the GPU idle before each."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times), min(times)


def host_breakdown(call: Callable[[], Any], calls: int = 50) -> str:
    """Median host microseconds per call spent inside each layer of the fusegraph path (each layer
    includes the ones below it): the partition module's forward (torch_partition.CompiledPartition),
    Plan.run, and CUDAGraph.replay; the rest of the call is Dynamo, AOTAutograd's runtime wrappers
    and the FX graph around the partition. Timed by wrapping each function with perf_counter."""
    from fusegraph.frontends.torch_partition import CompiledPartition
    from fusegraph.runtime.plan import Plan

    spent: dict[str, float] = {}
    layers = [("GraphModule call", torch.fx.GraphModule, "__call__"),
              ("CompiledPartition.forward", CompiledPartition, "forward"), ("Plan.run", Plan, "run")]
    originals = []
    for label, cls, attr in layers:
        original = getattr(cls, attr)
        originals.append((cls, attr, original))

        def wrapper(*a: Any, _f: Any = original, _label: str = label, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - start
        setattr(cls, attr, wrapper)
    rows: dict[str, list[float]] = {"whole call": []}
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            spent.clear()
            start = time.perf_counter()
            call()
            rows["whole call"].append((time.perf_counter() - start) * 1e6)
            for label, value in spent.items():
                rows.setdefault(label, []).append(value * 1e6)
    finally:
        for cls, attr, original in originals:
            setattr(cls, attr, original)
        torch.cuda.synchronize()
    return "host time per call by layer (median us, each layer inside the one before): " + \
        ", ".join(f"{label} {statistics.median(v):.1f}" for label, v in rows.items())


def host_ops(call: Callable[[], Any], calls: int = 20, rows: int = 15) -> str:
    """torch.profiler's CPU side of `calls` calls: host time per ATen op / CUDA runtime call, by total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return f"host ops over {calls} calls:\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)


def replay_source(run: Any) -> str:
    out = []
    for graph in getattr(getattr(run, "fusegraph_report", None), "graphs", []):
        for part in graph.partitions:
            runner = getattr(part.plan, "cuda_graph", None) if part.plan is not None else None
            if runner is not None and runner.replay_source:
                out.append(f"-- {part.name} per-call function:\n{runner.replay_source}")
    return "\n".join(out)


def replay_alone(run: Any, calls: int = 50) -> str:
    """Host microseconds of the captured graphs' replay() alone (GPU idle before each), per plan."""
    out = []
    for graph in getattr(getattr(run, "fusegraph_report", None), "graphs", []):
        for part in graph.partitions:
            runner = getattr(part.plan, "cuda_graph", None) if part.plan is not None else None
            captured = getattr(runner, "captured", None)
            if captured is None:
                continue
            times = []
            for _ in range(calls):
                torch.cuda.synchronize()
                start = time.perf_counter()
                captured.graph.replay()
                times.append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
            out.append(f"{part.name}: replay() alone {statistics.median(times):.1f} us host")
    return "; ".join(out) or "no captured plan"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="head")
    parser.add_argument("--impls", default="fusegraph,torch.compile")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    name = f"decode_host_{args.tag}.txt"
    base, x, pos = decode_setup()
    compilers: dict[str, Callable[[Any], Any]] = {
        "fusegraph": lambda m: fg.compile(m, mode="reduce-overhead"),
        "torch.compile": lambda m: torch.compile(m, mode="reduce-overhead")}
    for impl in args.impls.split(","):
        torch._dynamo.reset()
        block = copy.deepcopy(base).to(torch.bfloat16)
        step = T.DecodeStep(block, compilers[impl](block), x, pos)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dev = device_time(step, calls=50, repeats=5, graph=False).ms
        lat = call_latency(step)
        med, low = host_time_us(step)
        emit(f"== {args.tag} {impl} reduce-overhead: device back to back {dev:.4f} ms, latency {lat}, "
             f"host per call {med:.1f} us (min {low:.1f})\n{cuda_activity(step)}", name)
        if impl == "fusegraph":
            emit(host_breakdown(step), name)
            emit(replay_alone(step.run), name)
            emit(host_ops(step), name)
            emit(replay_source(step.run), name)
            emit(host_profile(step, args.rows, calls=20), name)
            report = getattr(step.run, "fusegraph_report", None)
            for graph in getattr(report, "graphs", []):
                for part in graph.partitions:
                    plan = part.plan
                    emit(f"-- {graph.kind} {part.name}: {part.status} {part.reason}\n"
                         f"{plan.explain() if plan is not None else ''}", name)
        del step, block
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
