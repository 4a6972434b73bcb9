"""A/B (and more) of fusegraph settings on one workload, in one process: each variant compiles its own
copy of the model with its settings, then the variants are timed in alternation, round after round,
so clock and thermal drift fall on all of them alike (separate runs of the GPT-2 step moved by
+-0.2 ms, more than the changes being judged).

    PYTHONPATH=src python bench/ab_gpu.py --workload gpt2_train \\
        --variant base: --variant padded:pad_results=1 --variant plain_cublas:cublas_epilogues=0

A variant is NAME:SETTING=VALUE,SETTING=VALUE (fusegraph.settings names; values as the environment
variables take them). Each round times every variant (device time of N back-to-back calls, CUDA
events); the table gives the median and best per variant and the ratio of medians to the first.
The first call's loss (GPT-2) or output norm is printed per variant as a sanity check. Text to
stdout and $OUT/ab.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
from fusegraph.perf.timing import call_latency, device_time
from fusegraph.settings import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import targets_gpu as T


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = text.partition(":")
    values: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        values[key.strip()] = raw.strip()   # parsed by override() as the environment variable would be
    return name or "base", values


def gpt2_step(batch: int) -> tuple[Callable[[], Callable[[], Any]], Callable[[Any], float]]:
    torch.manual_seed(0)
    base = T.LMWithLoss(T.gpt2("full")).cuda()
    ids = torch.randint(0, 50257, (batch, 1024), device="cuda")
    targets = torch.randint(0, 50257, (batch, 1024), device="cuda")

    def make() -> Callable[[], Any]:
        model = copy.deepcopy(base)
        step = T.TrainStep(model, fg.compile(model), ids, targets, torch.bfloat16)
        return step

    def check(step: Any) -> float:
        return float(step.loss_and_grads()[0])
    return make, check


def resnet(batch: int) -> tuple[Callable[[], Callable[[], Any]], Callable[[Any], float]]:
    base = T.resnet50("full").eval().cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)

    def make() -> Callable[[], Any]:
        compiled = fg.compile(copy.deepcopy(base))

        def call() -> Any:
            with torch.no_grad():
                return compiled(x)
        return call

    def check(call: Any) -> float:
        return float(call().float().norm())
    return make, check


def llama_decode() -> tuple[Callable[[], Callable[[], Any]], Callable[[Any], float]]:
    """The decode step of targets_gpu's llama_decode (b1, KV cache 2048, bf16) under mode="reduce-overhead"."""
    from llama_blocks import decode_setup

    base, x, pos = decode_setup()

    def make() -> Callable[[], Any]:
        block = copy.deepcopy(base).to(torch.bfloat16)
        return T.DecodeStep(block, fg.compile(block, mode="reduce-overhead"), x, pos)

    def check(step: Any) -> float:
        for _ in range(3):   # the warm-up and the capture
            step()
        return float(step().float().norm())
    return make, check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("gpt2_train", "resnet50", "llama_decode"), default="gpt2_train")
    parser.add_argument("--metric", choices=("device", "latency"), default="device",
                        help="device: N back-to-back calls between CUDA events; latency: events around one call "
                             "with the GPU idle before it (median of 50), what a decode loop waits for")
    parser.add_argument("--variant", action="append", required=True, help="NAME:SETTING=VALUE,... (repeat)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--batch", type=int, default=0, help="default: 8 (GPT-2), 128 (ResNet-50)")
    args = parser.parse_args()
    T.S.device = "cuda"
    from zoo_models import ensure_torchvision_importable
    ensure_torchvision_importable()
    variants = [parse_variant(v) for v in args.variant]
    if args.workload == "gpt2_train":
        make, check = gpt2_step(args.batch or 8)
    elif args.workload == "llama_decode":
        make, check = llama_decode()
    else:
        make, check = resnet(args.batch or 128)
    out = open(os.path.join(os.environ["OUT"], "ab.txt"), "a") if os.environ.get("OUT") else None  # noqa: SIM115

    def say(text: str) -> None:
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
            out.flush()

    say(f"== A/B {args.workload} ({args.metric}): {', '.join(f'{n} {v}' for n, v in variants)}")
    fns: list[Callable[[], Any]] = []
    for name, values in variants:
        with override(**values):
            fn = make()   # compiled at its first call, below, under these settings
            start = time.perf_counter()
            value = check(fn)   # the first call compiles, under this variant's settings
            torch.cuda.synchronize()
            say(f"   {name}: first call {time.perf_counter() - start:.1f} s, check value {value:.6g}")
        fns.append(fn)
    samples: list[list[float]] = [[] for _ in variants]
    for r in range(args.rounds):
        for k, ((_name, values), fn) in enumerate(zip(variants, fns, strict=True)):
            with override(**values):   # a recompile (a guard change) builds under the same settings
                samples[k].append(call_latency(fn).ms if args.metric == "latency" else
                                  device_time(fn, calls=args.calls, repeats=1, graph=False).ms)
        say(f"   round {r}: " + ", ".join(f"{n} {s[-1]:.3f}" for (n, _), s in zip(variants, samples, strict=True)))
    base_median = statistics.median(samples[0])
    say(f"\n   {'variant':24s} {'median ms':>10s} {'best ms':>9s} {'vs first':>9s}")
    for (name, _), s in zip(variants, samples, strict=True):
        med = statistics.median(s)
        say(f"   {name:24s} {med:10.3f} {min(s):9.3f} {base_median / med:9.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
