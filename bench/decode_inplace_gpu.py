"""Llama decode step: is the static KV cache written in place by fusegraph's Plan? (H21)

Builds bench/llama_blocks.py's LlamaDecodeBlock at bench/targets_gpu.py's llama_decode size (B1, 2048
cached positions, d4096, 32 heads, 8 KV heads, bf16), compiles it with fusegraph "default" and
"reduce-overhead", runs 4 decode steps (positions 2044..2047, a fresh token each) next to an eager twin
and checks every step's output and both caches against it; prints what became of each mutated input
(the compile report), the per-step device time (fusegraph.perf.timing.device_time) and the CUDA kernels
of one step (torch.profiler: names and counts; before this change a step had 2 direct_copy kernels and 4
DtoD memcpys for the cache clone + write-back).

    python bench/decode_inplace_gpu.py            # on the GPU; writes $OUT/decode_inplace.json if OUT is set
    python bench/decode_inplace_gpu.py --cpu      # a small CPU smoke run (no device timing)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections import Counter
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_blocks import LlamaDecodeBlock, LlamaSize


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernels_of_one_step(step: Any, cuda: bool) -> Counter[str]:
    """Kernel (and memcpy/memset) names and counts of one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    for event in prof.events():
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if (cuda and on_device) or (not cuda and event.name.startswith("aten::")):
            counts[event.name[:140]] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="small CPU smoke run")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --cpu for the smoke run)")
    device = "cuda" if cuda else "cpu"
    size = (LlamaSize(batch=1, seq=2048, dim=4096, heads=32, kv_heads=8, ffn=11008) if cuda
            else LlamaSize(batch=1, seq=32, dim=64, heads=4, kv_heads=2, ffn=128))
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = LlamaDecodeBlock(size).to(device)
    with torch.no_grad():   # a cache full of earlier tokens' keys and values
        base.k_cache.normal_()
        base.v_cache.normal_()
    base = base.to(dtype)
    tokens = [torch.randn(size.batch, 1, size.dim, device=device, dtype=dtype) for _ in range(args.steps)]
    positions = [torch.tensor([size.seq - args.steps + i], device=device) for i in range(args.steps)]
    out_dir = os.environ.get("OUT")
    results: dict[str, Any] = {"size": str(size), "dtype": str(dtype), "device": device, "impls": {}}
    print(f"Llama decode step {size}, {dtype}, {device}")

    for name, mode in (("eager", None), ("fusegraph", "default"), ("fusegraph reduce-overhead", "reduce-overhead")):
        torch._dynamo.reset()
        eager = copy.deepcopy(base)
        block = copy.deepcopy(base)
        run = block if mode is None else fg.compile(block, mode=mode)
        row: dict[str, Any] = {"steps": []}
        with torch.no_grad():
            for i, (x, pos) in enumerate(zip(tokens, positions, strict=True)):
                want, got = eager(x, pos), run(x, pos)
                errs = {"out": rel_err(got, want), "k_cache": rel_err(block.k_cache, eager.k_cache),
                        "v_cache": rel_err(block.v_cache, eager.v_cache)}
                row["steps"].append(errs)
                ok = all(e < tol for e in errs.values())
                print(f"  {name:28s} step {i} pos {int(pos[0])}: " +
                      ", ".join(f"{k} rel err {v:.2e}" for k, v in errs.items()) + ("" if ok else "  FAIL"))
            row["ok"] = all(e < tol for s in row["steps"] for e in s.values())
            report = getattr(run, "fusegraph_report", None)
            if report is not None:
                row["mutations"] = [str(m) for g in report.graphs for m in g.mutations]
                row["partitions"] = [(p.name, p.status, p.kernel_ops) for g in report.graphs for p in g.partitions]
                print("  " + "\n  ".join(str(report).splitlines()))

            def step(run: Any = run) -> Any:
                return run(tokens[-1], positions[-1])

            if cuda:
                timing = device_time(step)
                row["device_ms"], row["timing"] = timing.ms, timing.method
                print(f"  {name}: {timing.ms:.4f} ms per step ({timing.method})")
            for _ in range(3):   # warm (captured CUDA graphs replay)
                step()
            kernels = kernels_of_one_step(step, cuda)
        row["kernels"] = dict(kernels)
        copies = {k: v for k, v in kernels.items() if "copy" in k.lower() or "memcpy" in k.lower()}
        row["copy_kernels"] = copies
        print(f"  {name}: {sum(kernels.values())} kernel(s)/op(s) in one step; copies: {copies or 'none'}")
        for kname, count in kernels.most_common():
            print(f"    {count:3d} x {kname}")
        results["impls"][name] = row
    print("ALL OK" if all(r["ok"] for r in results["impls"].values()) else "MISMATCH")
    if out_dir:
        with open(os.path.join(out_dir, "decode_inplace.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
