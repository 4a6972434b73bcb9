"""ResNet-50 inference (b128, bf16, channels_last) under fg.compile: back-to-back device time vs one call's
latency, and where the host's Python time goes per call (cProfile of 10 calls). For when back-to-back
time exceeds single-call latency (host work after the outputs are ready).

    PYTHONPATH=src python bench/resnet_host_gpu.py [--batch 128]
"""

from __future__ import annotations

import argparse
import os
import sys

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
    args = parser.parse_args()
    T.S.device = "cuda"
    ensure_torchvision_importable()
    model = T.resnet50("full").eval().cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    compiled = fg.compile(model)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return compiled(x)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dev = device_time(call, calls=20, repeats=3, graph=False).ms
    lat = call_latency(call)
    emit(f"device back to back {dev:.3f} ms, latency {lat}\n{host_profile(call, 18, calls=10)}", "resnet_host.txt")


if __name__ == "__main__":
    main()
