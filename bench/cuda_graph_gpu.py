"""CUDA-graph replay of a whole Plan vs kernel-by-kernel launches, on the GPU (< 2 minutes).

    PYTHONPATH=src python bench/cuda_graph_gpu.py            # JSON to $OUT/cuda_graph.json (or stdout)

1. The demo transformer block (medium, bf16, 17 kernels) built with cuda_graphs=False and True:
   correctness vs eager (fp32 and bf16) on three calls with different x (the graph reads a copy of x
   and its weights, declared static, in place), per-call latency (cuda events around one synchronized
   call, median of 50), host-bound throughput (50 calls back to back), device time per call
   (profiler), and what the automatic rule decides for this plan. "graph_copy_all" is the same block
   with no static inputs (every weight copied per call, as before static inputs existed);
   "moved_static_input" checks a call with other weight tensors (runs kernel by kernel, still correct).
2. A one-kernel plan (exp over 4096 floats): host overhead per call, plain vs forced graph vs eager.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import fusegraph as fg
from fusegraph.commands.demo_blocks import SIZES, transformer_block
from fusegraph.runtime.cuda_graph import CudaGraphWarning, decide


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30))


def latency_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    """Median over `calls` of one synchronized call's span between cuda events (host gaps included)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_us_per_call(fn: Callable[[], Any], calls: int = 50) -> float:
    """Back-to-back calls, synchronized once: max(host time, device time) per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def device_ms_per_call(fn: Callable[[], Any], calls: int = 20) -> float:
    """Sum of the CUDA kernels' time per call (torch.profiler; kernels inside a graph are counted)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        us: Any = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        total_us += float(us)
    return total_us / calls / 1e3


def transformer() -> dict[str, Any]:
    size = SIZES["medium"][0]
    block = transformer_block(size, torch.bfloat16, "cuda")
    names = list(block.named_tensors)
    inputs = list(block.feeds.values())
    t0 = time.perf_counter()
    plain = block.graph.build(cuda_graphs=False)
    build_plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    graphed = block.graph.build(cuda_graphs=True)
    build_graph_s = time.perf_counter() - t0
    copy_all = transformer_block(size, torch.bfloat16, "cuda", static_weights=False).graph.build(cuda_graphs=True)
    auto = decide(None, "cuda", plain.kernels, plain.graph.inputs,
                  static_inputs=plain.static_inputs)
    result: dict[str, Any] = {"block": block.description, "kernels": len(plain.kernels),
                              "build_s": {"plain": round(build_plain_s, 2), "graph": round(build_graph_s, 2)},
                              "auto_decision": {"capture": auto.capture, "note": auto.note}}
    checks = []
    gen = torch.Generator(device="cuda").manual_seed(5)
    for call in range(3):   # call 0 is the warm-up + capture, calls 1, 2 replay with new x
        x = inputs[0] if call == 0 else torch.randn(inputs[0].shape, generator=gen, device="cuda").to(torch.bfloat16)
        feeds = [x, *inputs[1:]]
        named = dict(zip(names, feeds, strict=True))
        ref32 = block.eager({k: v.float() for k, v in named.items()})
        ref16 = block.eager(named)
        out_plain, out_graph, out_copy_all = plain(*feeds), graphed(*feeds), copy_all(*feeds)
        checks.append({"call": call, "graph_vs_fp32": rel_err(out_graph, ref32),
                       "graph_copy_all_vs_fp32": rel_err(out_copy_all, ref32),
                       "plain_vs_fp32": rel_err(out_plain, ref32),
                       "eager_bf16_vs_fp32": rel_err(ref16, ref32),
                       "graph_vs_plain_max_abs": float((out_graph.float() - out_plain.float()).abs().max())})
    result["correctness"] = checks
    result["captured"] = graphed.cuda_graph_captured
    result["note"] = graphed.cuda_graph_note
    result["copies_per_call"] = graphed.cuda_graph_copies
    result["static_inputs"] = len(graphed.static_inputs)
    result["copy_all_copies_per_call"] = copy_all.cuda_graph_copies
    result["copy_all_captured"] = copy_all.cuda_graph_captured
    moved = [inputs[0], *(t.clone() for t in inputs[1:])]   # the same values in other tensors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_moved = graphed(*moved)
    result["moved_static_input"] = {
        "max_abs_vs_plain": float((out_moved.float() - plain(*moved).float()).abs().max()),
        "warned": any(issubclass(w.category, CudaGraphWarning) for w in caught),
        "kernel_by_kernel_calls": graphed.cuda_graph.moved_calls if graphed.cuda_graph else None}
    torch.cuda.synchronize()
    first = graphed(*inputs)
    kept = first.clone()
    graphed(torch.zeros_like(inputs[0]), *inputs[1:])   # the next replay
    torch.cuda.synchronize()
    result["earlier_output_intact"] = bool(torch.equal(first, kept))

    def eager_call() -> Any:
        return block.eager(block.named_tensors)

    fns = {"plain": lambda: plain(*inputs), "graph": lambda: graphed(*inputs),
           "graph_copy_all": lambda: copy_all(*inputs), "eager": eager_call}
    result["latency_ms_median50"] = {k: round(latency_ms(f), 4) for k, f in fns.items()}
    result["wall_us_per_call_back_to_back"] = {k: round(wall_us_per_call(f), 1) for k, f in fns.items()}
    result["device_ms_per_call"] = {k: round(device_ms_per_call(f), 4) for k, f in fns.items()}
    return result


def one_kernel() -> dict[str, Any]:
    g = fg.Graph(name="one_exp", compute_dtype="float32")
    x = g.tensor((4096,), dtype="float32", name="x")
    g.exp(x).set_output()
    plain = g.build("cuda", cuda_graphs=False)
    graphed = g.build("cuda", cuda_graphs=True)
    x_t = torch.randn(4096, device="cuda")
    for _ in range(2):
        graphed(x_t)
    auto = decide(None, "cuda", plain.kernels, plain.graph.inputs)
    fns = {"plain": lambda: plain(x_t), "graph": lambda: graphed(x_t), "eager": lambda: torch.exp(x_t)}
    return {"kernels": len(plain.kernels), "captured": graphed.cuda_graph_captured, "note": graphed.cuda_graph_note,
            "auto_decision": {"capture": auto.capture, "note": auto.note},
            "correct": bool(torch.allclose(graphed(x_t), torch.exp(x_t), rtol=1e-5, atol=1e-6)),
            "host_us_per_call_back_to_back": {k: round(wall_us_per_call(f, 500), 2) for k, f in fns.items()},
            "latency_ms_median50": {k: round(latency_ms(f), 4) for k, f in fns.items()}}


def main() -> None:
    t0 = time.perf_counter()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformer_medium_bf16": transformer(), "one_kernel_plan": one_kernel()}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=2)
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cuda_graph.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
