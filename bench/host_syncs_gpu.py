"""Where a compiled training step's host time goes: launch gaps and host<->device synchronizations.

    PYTHONPATH=src python bench/host_syncs_gpu.py --layers 2 [--batch 8]

Builds the GPT-2 training step of bench/targets_gpu.py (HF GPT-2 with --layers blocks, batch x 1024 tokens,
autocast bf16, fused AdamW), compiles it with fusegraph, and reports for one step:
- device time back to back (CUDA events) against the sum of its kernels' times: the difference is time the
  GPU waited for the host;
- the host-side calls that block the host on the GPU (cudaStreamSynchronize, cudaDeviceSynchronize,
  cudaMemcpy, aten::item / _local_scalar_dense, cudaEventSynchronize), each with the innermost Python frames
  of fusegraph or torch that issued it (torch.profiler with_stack);
- the CPU ops with the most self time.
Text to stdout and $OUT/host_syncs.txt when OUT is set. Run with FUSEGRAPH_DEBUG=1 to also see the
compiler's decisions (e.g. why a causal mask was kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T
from zoo_models import ensure_torchvision_importable

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize",
              "aten::item", "aten::_local_scalar_dense", "cudaMemcpyAsync")


def gpt2_step(layers: int, batch: int) -> T.TrainStep:
    from transformers import GPT2Config, GPT2LMHeadModel
    from zoo_models import TensorOutput

    torch.manual_seed(0)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, n_layer=layers)
    model = T.LMWithLoss(TensorOutput(GPT2LMHeadModel(cfg), "logits")).cuda()
    ids = torch.randint(0, cfg.vocab_size, (batch, 1024), device="cuda")
    targets = torch.randint(0, cfg.vocab_size, (batch, 1024), device="cuda")
    return T.TrainStep(model, fg.compile(model), ids, targets, torch.bfloat16)


def python_frames(event: Any, keep: int = 4) -> str:
    stack = [f for f in (getattr(event, "stack", None) or []) if "fusegraph" in f or "torch/" in f]
    return " <- ".join(stack[:keep]) or "(no Python stack)"


def report(step: T.TrainStep, rows: int) -> str:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = device_time(step, calls=10, repeats=3, graph=False).ms
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    events = list(prof.events())
    kernel_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    lines = [f"device time back to back {ms:.3f} ms per step; kernels summed {kernel_us / 1e3:.3f} ms"]
    syncs = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and
             any(e.name.startswith(s) for s in SYNC_NAMES)]
    by_site: dict[tuple[str, str], list[float]] = {}
    for e in syncs:
        by_site.setdefault((e.name, python_frames(e)), []).append(e.cpu_time_total)
    lines.append(f"\nhost calls that can block on the GPU: {len(syncs)}")
    for (name, site), times in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"  {sum(times) / 1e3:8.3f} ms {len(times):4d}x {name}  at {site[:400]}")
    lines.append("\nCPU ops by self time:")
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    return "\n".join(lines)


def host_profile(step: Callable[[], Any], rows: int, calls: int = 5) -> str:
    """cProfile of `calls` calls (after warm-up): where the host's Python time goes, by own time."""
    import cProfile
    import io
    import pstats

    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return f"host Python profile of {calls} calls:\n" + out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--cprofile", action="store_true", help="also: Python functions by host time over 5 steps")
    args = parser.parse_args()
    T.S.device = "cuda"
    ensure_torchvision_importable()
    step = gpt2_step(args.layers, args.batch)
    text = f"== GPT-2 train step, {args.layers} layers, batch {args.batch}x1024, fusegraph default\n" + \
        report(step, args.rows)
    if args.cprofile:
        text += "\n\n" + host_profile(step, args.rows * 2)
    emit(text, "host_syncs.txt")


def emit(text: str, name: str) -> None:
    """Print `text` and append it to $OUT/`name` when OUT is set."""
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
