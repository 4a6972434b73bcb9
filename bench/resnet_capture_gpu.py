"""ResNet-50 inference (bf16, channels_last): does capturing the Plan in a CUDA graph pay at batch 128,
and what does the 3-channel stem convolution cost against the same convolution with its input channels
zero-padded to 4 or 8?

For fusegraph "default" (the automatic capture rule) and "reduce-overhead" (always captured), next to
torch.compile: back-to-back device time, one call's latency, and the host time of one call (until it
returns, launches queued), first in a fresh process and again with a few million live Python objects
(what a long-lived training or serving process holds; the garbage collector's passes grow with them).

Then the BN statistics are changed in place (random per-channel factors) and every implementation is
compared with eager again: a captured plan baked the folded BN vectors into its graph and must refold them.

    PYTHONPATH=src python bench/resnet_capture_gpu.py [--batch 128]      # writes $OUT/resnet_capture.txt
    PYTHONPATH=src python bench/resnet_capture_gpu.py --bn-check-only    # fusegraph default + the BN check
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.perf.timing import call_latency, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T
from host_syncs_gpu import emit
from resnet_host_gpu import cuda_activity
from zoo_models import ensure_torchvision_importable

OUT_NAME = "resnet_capture.txt"


def host_ms(call: Callable[[], Any], calls: int = 20) -> float:
    """Median host milliseconds until one call returns (the GPU idle at its start)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def measure(name: str, call: Callable[[], Any]) -> str:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dev = device_time(call, calls=20, repeats=3, graph=False).ms
    lat = call_latency(call).ms
    return f"{name:28s} back-to-back {dev:7.3f} ms  latency {lat:7.3f} ms  host {host_ms(call):7.3f} ms"


def stem_conv(batch: int) -> list[str]:
    """The stem conv (7x7, stride 2, 3 -> 64 channels) as torch runs it, and with padded channels."""
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(64, 3, 7, 7, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    want = F.conv2d(x, w, stride=2, padding=3)
    lines = [f"stem conv b{batch} 3->64 7x7/2 channels_last bf16:"]
    for channels in (3, 4, 8):
        xp = F.pad(x, (0, 0, 0, 0, 0, channels - 3)).contiguous(memory_format=torch.channels_last)
        wp = F.pad(w, (0, 0, 0, 0, 0, channels - 3)).contiguous(memory_format=torch.channels_last)
        got = F.conv2d(xp, wp, stride=2, padding=3)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        conv = device_time(lambda xp=xp, wp=wp: F.conv2d(xp, wp, stride=2, padding=3)).ms
        pad = device_time(lambda: F.pad(x, (0, 0, 0, 0, 0, channels - 3)).contiguous(
            memory_format=torch.channels_last)).ms if channels > 3 else 0.0
        lines.append(f"  C={channels}: conv {conv:.4f} ms, pad {pad:.4f} ms, rel err vs C=3 {err:.1e}")
    return lines


def bn_update_check(model: torch.nn.Module, calls: dict[str, Callable[[], Any]], x: torch.Tensor) -> str:
    """Every implementation's output after the BN statistics change in place (random per-channel
    factors), against eager's; and how far eager moved, so that a stale result would show."""
    with torch.no_grad():
        before = model(x).float()
        g = torch.Generator(device=x.device).manual_seed(1)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                shape, dev = m.running_var.shape, m.running_var.device
                m.running_var.mul_(torch.rand(shape, generator=g, device=dev) + 0.5)
                m.running_mean.add_(torch.randn(shape, generator=g, device=dev) * 0.1)
        want = model(x).float()
        moved = float((want - before).norm() / before.norm())
        lines = [f"after an in-place BN update (eager moved by {moved:.2e} rel, output norm {float(want.norm()):.3e}):"]
        for name, call in calls.items():
            got = call().float()
            err = float((got - want).norm() / want.norm())
            lines.append(f"  {name:26s} rel err vs eager {err:.1e} ({'ok' if err < 2e-2 else 'WRONG'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--bn-check-only", action="store_true",
                        help="fusegraph default only: its timing and the in-place BN update check")
    parser.add_argument("--explain", action="store_true", help="also each fusegraph plan's explain()")
    args = parser.parse_args()
    T.S.device = "cuda"
    ensure_torchvision_importable()
    if not args.bn_check_only:
        emit("\n".join(stem_conv(args.batch)), OUT_NAME)
    model = T.resnet50("full").eval().cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    impls = {"eager": model} if args.bn_check_only else {"eager": model, "torch.compile": torch.compile(model)}
    for mode in ("default",) if args.bn_check_only else ("default", "reduce-overhead"):
        impls[f"fusegraph {mode}"] = fg.compile(model, mode=mode)
    calls = {}
    for name, m in impls.items():
        def call(m: Any = m) -> torch.Tensor:
            with torch.no_grad():
                return m(x)
        calls[name] = call
        emit(measure(name, call), OUT_NAME)
        emit(f"    {cuda_activity(call)}", OUT_NAME)
        report = getattr(m, "fusegraph_report", None)
        for graph in getattr(report, "graphs", []):
            for part in graph.partitions:
                plan = part.plan
                if plan is not None:
                    emit(f"    {part.name}: {plan.cuda_graph_note}", OUT_NAME)
                    if args.explain:
                        emit(plan.explain(), OUT_NAME)
                        for k in plan.kernels[:2]:   # the stem: which candidate won, and the tuning
                            emit(f"    {k.name}: {k.backend} {k.config} {k.tuning} {k.note}", OUT_NAME)
    # BN statistics written in place (a model evaluated between training epochs): a captured plan
    # baked the folded BN vectors into its graph and must refold them before replaying
    emit(bn_update_check(model, calls, x), OUT_NAME)
    if args.bn_check_only:
        return
    ballast = [{"i": i, "t": (i, str(i))} for i in range(3_000_000)]   # live objects the GC walks
    emit(f"-- with {len(ballast)} live Python objects", OUT_NAME)
    for name, call in calls.items():
        emit(measure(name, call), OUT_NAME)


if __name__ == "__main__":
    main()
