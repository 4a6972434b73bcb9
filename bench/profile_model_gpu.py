"""Where the time of one compiled zoo model goes, kernel by kernel, on the GPU: fusegraph's plan
kernels (fg.explain) and the CUDA kernels torch's profiler sees in one call, for fusegraph and for
torch.compile side by side.

    PYTHONPATH=src python bench/profile_model_gpu.py tv_resnet50 --batch 32 --dtype bfloat16 --channels-last

Writes the two tables to stdout (and $OUT/profile_<model>.txt when OUT is set).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args()
    ensure_torchvision_importable()
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
