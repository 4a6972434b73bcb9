"""Where the time of one compiled zoo model goes, kernel by kernel, on the GPU: fusegraph's plan
kernels (fg.explain) and the CUDA kernels torch's profiler sees in one call, for fusegraph and for
torch.compile side by side.

    PYTHONPATH=src python bench/profile_model_gpu.py tv_resnet50 --batch 32 --dtype bfloat16 --channels-last
    PYTHONPATH=src python bench/profile_model_gpu.py tv_resnet50 --batch 16 --train    # forward + loss + backward

--train profiles one training step (fp32 weights under bf16 autocast, as bench/zoo.py --train, without the
optimizer) for eager, fusegraph and torch.compile, and lists each fusegraph partition's kernels.

Writes the two tables to stdout (and $OUT/profile_<model>.txt when OUT is set).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from contextlib import redirect_stdout
from typing import Any

import torch

import fusegraph as fg

sys.path.insert(0, os.path.dirname(__file__))
from zoo_models import ensure_torchvision_importable, get


def profile_calls(fn: Any, inputs: tuple[Any, ...], rows: int) -> str:
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    return (f"wall {wall_ms:.2f} ms per call; device time {kernel_ms:.2f} ms in {launches} kernel/memcpy calls\n"
            + str(events.table(sort_by="cuda_time_total", row_limit=rows)))


def profile_stacks(fn: Any, rows: int) -> str:
    """The torch ops called from Python (not our generated kernels) that launch device work, with
    their input shapes and the Python stack that called them, by total device time: where copies
    and layout conversions come from."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True, record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    spent: dict[tuple[str, str, str], list[float]] = {}
    for e in prof.events():
        kernels = [k for k in getattr(e, "kernels", []) if not k.name.startswith("fg_")]
        if not kernels or not e.name.startswith("aten::"):
            continue
        stack = " <- ".join(line.split("/")[-1] for line in (e.stack or [])[:4])
        key = (e.name, str(e.input_shapes)[:90], stack)
        entry = spent.setdefault(key, [0.0, 0])
        entry[0] += sum(k.duration for k in kernels)
        entry[1] += 1
    lines = [f"{us:9.1f} us {n:4d}x {name} {shapes}\n              {stack}"
             for (name, shapes, stack), (us, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:rows]]
    return "\n".join(lines)


def train_step(entry: Any, model: torch.nn.Module, fwd: Any, inputs: tuple[Any, ...], target: Any) -> Any:
    def step(*_: Any) -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(*inputs)
        entry.loss(out, target).backward()
    return step


def profile_train(args: argparse.Namespace, entry: Any) -> str:
    model = entry.build("full").to("cuda").train()
    ex = entry.example(args.batch, torch.float32, "cuda", "full")
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    inputs = tuple(i.to(memory_format=torch.channels_last) if args.channels_last and i.dim() == 4 else i
                   for i in ex.inputs)
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(f"== {args.model} training step, batch {args.batch}, bf16 autocast, channels_last={args.channels_last}")
        print("== eager: CUDA kernels of one step")
        print(profile_calls(train_step(entry, model, model, inputs, ex.target), (), args.rows))
        compiled = fg.compile(model)
        step = train_step(entry, model, compiled, inputs, ex.target)
        print("== fusegraph: CUDA kernels of one step")
        print(profile_calls(step, (), args.rows))
        if args.stacks:
            print("== fusegraph: torch ops that launch kernels, by Python stack (device time)")
            print(profile_stacks(step, args.rows))
        report = compiled.fusegraph_report
        print(report)
        for graph in report.graphs:
            for part in graph.partitions:
                print(f"-- {graph.kind} {part.name}: {part.status}, {part.kernels} kernel(s)")
                for line in part.kernel_ops:
                    print(f"     {line[:200]}")
        if not args.no_inductor:
            torch._dynamo.reset()
            print("== torch.compile (inductor): CUDA kernels of one step")
            print(profile_calls(train_step(entry, model, torch.compile(model), inputs, ex.target), (), args.rows))
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--train", action="store_true", help="one training step (forward + loss + backward)")
    parser.add_argument("--stacks", action="store_true", help="--train: also the torch ops by Python stack")
    args = parser.parse_args()
    ensure_torchvision_importable()
    if args.train:
        text = profile_train(args, get(args.model))
        print(text)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"profile_train_{args.model}.txt"), "w") as f:
                f.write(text)
        return
    dtype = getattr(torch, args.dtype)
    entry = get(args.model)
    model = entry.build("full").to("cuda", dtype).eval()
    inputs = entry.example(args.batch, dtype, "cuda", "full").inputs
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = tuple(i.to(memory_format=torch.channels_last) if i.dim() == 4 else i for i in inputs)
    buf = io.StringIO()
    with torch.no_grad(), redirect_stdout(buf):
        print(f"== {args.model} batch {args.batch} {args.dtype} channels_last={args.channels_last}")
        print(fg.explain(model, *inputs))
        compiled = fg.compile(model)
        print("== fusegraph: CUDA kernels of one call")
        print(profile_calls(compiled, inputs, args.rows))
        if not args.no_inductor:
            torch._dynamo.reset()
            print("== torch.compile (inductor): CUDA kernels of one call")
            print(profile_calls(torch.compile(model), inputs, args.rows))
    text = buf.getvalue()
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_{args.model}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
