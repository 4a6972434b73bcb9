"""Where a compiled zoo model's memory goes: what fusegraph holds between calls and at its peak,
attributed to the allocating call sites (torch's CUDA memory history), beside eager's peak.

Per model (quick batch: a quarter of the zoo's, bf16, inference under no_grad): eager's peak over one
call; then fg.compile, three warm-up calls (build, capture), and: held = bytes allocated after them
beyond what was allocated before compiling, peak = the max over one more call, the output's bytes;
the live blocks (>= 1 MiB, grouped by memory pool and the fusegraph/torch.cuda frames that
allocated them), and each Plan's memory line and CUDA-graph note. This is how the eleventh session
found a cuBLAS workspace per captured plan (a fresh side stream per capture) and captured outputs
cloned at every call.

    PYTHONPATH=src python bench/memory_attribution_gpu.py                 # H200: ~1 minute
    PYTHONPATH=src python bench/memory_attribution_gpu.py hf_llama_small  # named zoo models

Writes memory_attribution.txt to $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import ensure_torchvision_importable, get

DEFAULT_MODELS = ("hf_bert_base", "hf_llama_small", "timm_deit_tiny_patch16_224")


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def site(block: dict[str, Any]) -> str:
    """The allocating frames worth naming: fusegraph's and torch.cuda's (else the first four)."""
    frames = block.get("frames") or []
    named = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames]
    ours = [n for f, n in zip(frames, named, strict=True)
            if "fusegraph" in f["filename"] or "torch/cuda" in f["filename"]]
    return " < ".join(ours[:5] or named[:4])


def settle() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def attribute(name: str) -> list[str]:
    import fusegraph as fg

    entry = get(name)
    model = entry.build("full").eval().cuda().to(torch.bfloat16)
    example = entry.example(max(1, entry.batch // 4), torch.float32, "cuda", "full")
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in example.inputs)
    lines = []
    with torch.no_grad():
        model(*inputs)   # warm-up: cuDNN/cuBLAS handles and workspaces are eager's, before the baseline
        base = settle()
        torch.cuda.reset_peak_memory_stats()
        out = model(*inputs)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_allocated() - base
        del out
        torch._dynamo.reset()
        base = settle()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        compiled = fg.compile(model)
        for _ in range(3):
            out = compiled(*inputs)
            del out
        torch.cuda.synchronize()
        gc.collect()
        held = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out = compiled(*inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out_bytes = out.untyped_storage().nbytes() if isinstance(out, torch.Tensor) else 0
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        lines.append(f"== {name}: eager peak {mib(eager_peak)} MiB; fusegraph held {mib(held)} MiB, "
                     f"peak {mib(peak)} MiB, output {mib(out_bytes)} MiB")
        sizes: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        for segment in snapshot["segments"]:
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    key = (str(segment.get("segment_pool_id")), site(block))
                    sizes[key][0] += block["size"]
                    sizes[key][1] += 1
        for (pool, where), (size, count) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
            if size >= 1 << 20 and where:
                lines.append(f"   {mib(size):>8s} MiB in {count:4d} block(s), pool {pool}: {where}")
        for graph in compiled.fusegraph_report.graphs:
            for part in graph.partitions:
                if part.plan is not None:
                    lines.append(f"   {part.name}: {str(part.plan).splitlines()[-1].strip()}")
                    lines.append(f"   {part.name}: {part.plan.cuda_graph_note}")
        del out, compiled
        torch._dynamo.reset()
    del model
    settle()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), help="zoo model names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_attribution_gpu.py needs a GPU (torch.cuda memory history)")
    ensure_torchvision_importable()
    out_dir = os.environ.get("OUT")
    for name in args.models:
        text = "\n".join(attribute(name))
        print(text, flush=True)
        if out_dir:
            with open(os.path.join(out_dir, "memory_attribution.txt"), "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
