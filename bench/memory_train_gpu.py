"""Where a training step's peak memory goes: eager against fusegraph (and torch.compile), per phase and
per allocating call site, for one zoo model (the step of bench/zoo.py --train: bf16 autocast, fp32
weights, fused AdamW run eagerly).

    PYTHONPATH=src python bench/memory_train_gpu.py tv_resnet50 --batch 64      # H200: ~2 minutes
    PYTHONPATH=src python bench/memory_train_gpu.py hf_gpt2 --batch 16 --inductor

Per implementation, after three warm-up steps (compilation, CUDA-graph capture):
- phases: bytes allocated at the step's start (weights, AdamW state; gradients are dropped by
  zero_grad(set_to_none=True)), the peak inside the forward, the backward and the optimizer step (each
  with torch.cuda.reset_peak_memory_stats() at its start), and what is allocated at each phase's end;
  beside each peak, the peak reserved (segments the caching allocator holds, a captured graph's private
  pool included: what max_memory_allocated does not count once capture has freed those blocks);
- the peak's contents: torch's allocator history of one more step (Python stacks) replayed event by
  event from the bytes allocated at its start; at the step's highest point, the live allocations made
  during the step grouped by their innermost non-torch frames, largest first.

A CUDA graph's private pool counts only while its blocks are allocated: blocks that a captured plan keeps
between calls (its outputs, buffers) are part of "allocated at start" or of the step; blocks freed back to
the pool after capture are reserved, not allocated, as for every implementation here.

Writes memory_train_<model>.txt to $OUT when OUT is set, and to stdout.
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import os
import sys
from contextlib import redirect_stdout
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import ensure_torchvision_importable, get

import fusegraph as fg

MIB = 2**20


def phased_step(entry: Any, model: torch.nn.Module, fwd: Any, inputs: tuple[Any, ...], target: Any,
                opt: torch.optim.Optimizer) -> Any:
    """One training step; with `marks` a list, appends (phase, allocated at its end, peak allocated
    inside it, peak reserved inside it)."""
    def step(marks: list[tuple[str, float, float, float]] | None = None) -> None:
        def mark(name: str) -> None:
            if marks is not None:
                torch.cuda.synchronize()
                marks.append((name, torch.cuda.memory_allocated() / MIB, torch.cuda.max_memory_allocated() / MIB,
                              torch.cuda.max_memory_reserved() / MIB))
                torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        mark("start")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(*inputs)
        loss = entry.loss(out, target)
        mark("forward + loss")
        loss.backward()
        del out, loss
        mark("backward")
        opt.step()
        mark("optimizer")
    return step


def site(frames: list[dict[str, Any]]) -> str:
    """The innermost two frames outside torch's own Python (the code that asked for the memory)."""
    mine = [f for f in frames if "/torch/" not in f["filename"] or "/torch/optim/" in f["filename"]]
    picked = mine[:2] or frames[:1]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in picked) or "(no frames)"


def replay_peak(trace: list[dict[str, Any]], base: int) -> tuple[int, int, list[tuple[int, str]]]:
    """Replay an allocator trace (torch.cuda.memory._snapshot()'s device_traces entry) from `base`
    bytes allocated: (the highest total, the index of the event that reached it, the (bytes, site) of
    each allocation made during the trace and live then). Frees of blocks allocated before the trace
    began are not in `live`, so they do not lower the total: the peak is an upper bound when the step
    frees older memory first (zero_grad's gradients)."""
    live: dict[int, tuple[int, str]] = {}
    total = best = base
    best_live: dict[int, tuple[int, str]] = {}
    best_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], site(ev.get("frames", [])))
            total += ev["size"]
            if total > best:
                best, best_live, best_at = total, dict(live), i
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, best_at, list(best_live.values())


def peak_contents(step: Any, rows: int) -> str:
    """Replay one step's allocator history: the live allocations (made during the step) at its peak."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    best, best_at, best_live = replay_peak(trace, base)
    by_site: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where in best_live:
        by_site[where][0] += size
        by_site[where][1] += 1
    lines = [f"peak {best / MIB:.1f} MiB at event {best_at} of {len(trace)}: {base / MIB:.1f} MiB allocated at "
             f"the step's start (gradients included) + {(best - base) / MIB:.1f} MiB allocated during the step "
             f"and live then:"]
    for where, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"  {size / MIB:9.1f} MiB  {count:5d} blocks  {where}")
    return "\n".join(lines)


def measure(label: str, entry: Any, model: torch.nn.Module, fwd: Any, inputs: tuple[Any, ...], target: Any,
            rows: int) -> str:
    gc.collect()
    torch.cuda.empty_cache()   # the previous implementation's cached segments: reserved is then this one's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    step = phased_step(entry, model, fwd, inputs, target, opt)
    for _ in range(3):
        step()
    marks: list[tuple[str, float, float, float]] = []
    torch.cuda.reset_peak_memory_stats()
    step(marks)
    out = [f"== {label}"]
    for name, allocated, peak, reserved in marks:
        out.append(f"  {name:16s} allocated at end {allocated:9.1f} MiB, peak inside {peak:9.1f} MiB "
                   f"(reserved {reserved:9.1f} MiB: the caching allocator's segments, CUDA-graph pools included)")
    out.append(peak_contents(step, rows))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--inductor", action="store_true", help="torch.compile (Inductor) too")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    ensure_torchvision_importable()
    entry = get(args.model)
    model = entry.build("full").to("cuda").train()
    ex = entry.example(args.batch, torch.float32, "cuda", "full")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(f"== {args.model} training step, batch {args.batch}, bf16 autocast, fused AdamW")
        print(measure("eager", entry, model, model, ex.inputs, ex.target, args.rows))
        model.load_state_dict(state)
        compiled = fg.compile(model)
        print(measure("fusegraph", entry, model, compiled, ex.inputs, ex.target, args.rows))
        del compiled
        if args.inductor:
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            model.load_state_dict(state)
            print(measure("torch.compile", entry, model, torch.compile(model), ex.inputs, ex.target, args.rows))
    text = buf.getvalue()
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"memory_train_{args.model}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
