"""ResNet-50 inference (b128, bf16, channels_last) under fg.compile: back-to-back device time vs one call's
latency, and where the host's Python time goes per call (cProfile of 10 calls). For when back-to-back
time exceeds single-call latency (host work after the outputs are ready).

    PYTHONPATH=src python bench/resnet_host_gpu.py [--batch 128] [--tag NAME] [--layout nchw]

Also prints the CUDA activity of one call (kernel / memcpy counts and summed time, whether a CUDA graph
was launched) and each compiled Plan's explain() (backend picked per kernel, capture decision), so two
source trees can be compared with --tag.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import call_latency, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T
from host_syncs_gpu import emit, host_profile
from zoo_models import ensure_torchvision_importable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tag", default="head", help="names the output file resnet_host_<tag>.txt")
    parser.add_argument("--layout", choices=("channels_last", "nchw"), default="channels_last")
    args = parser.parse_args()
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    T.S.device = "cuda"
    ensure_torchvision_importable()
    model = T.resnet50("full").eval().cuda().to(dtype=torch.bfloat16, memory_format=fmt)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt)
    compiled = fg.compile(model)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return compiled(x)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dev = device_time(call, calls=20, repeats=3, graph=False).ms
    lat = call_latency(call)
    name = f"resnet_host_{args.tag}.txt"
    emit(f"== {args.tag}: ResNet-50 b{args.batch} bf16 {args.layout}\n"
         f"device back to back {dev:.3f} ms, latency {lat}\n{cuda_activity(call)}", name)
    emit(host_profile(call, 18, calls=10), name)
    report = getattr(compiled, "fusegraph_report", None)
    for graph in getattr(report, "graphs", []):
        for part in graph.partitions:
            plan = part.plan
            emit(f"-- {graph.kind} {part.name}: {part.status} {part.reason}\n"
                 f"{plan.explain() if plan is not None else ''}", name)


def cuda_activity(call: Callable[[], Any]) -> str:
    """Counts and summed device time of one call's CUDA kernels, memcpys and memsets, by kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = {}
    graph_launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = "memcpy" if "emcpy" in e.name else "memset" if "emset" in e.name else "kernel"
            kinds.setdefault(kind, []).append(e.device_time_total)
        elif "GraphLaunch" in e.name:
            graph_launches += 1
    parts = [f"{k}: {len(v)} ({sum(v) / 1e3:.3f} ms)" for k, v in sorted(kinds.items())]
    return f"one call: {', '.join(parts)}; cudaGraphLaunch x{graph_launches}"


if __name__ == "__main__":
    main()
