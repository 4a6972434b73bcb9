"""Host time of one call through torch.compile(backend=fusegraph), on the CPU: what the backend's glue
costs per call, apart from the kernels (which run through the torch reference here).

A small MLP (two 8x8 linear layers and a GELU, batch 2) compiled with fg.compile four ways: handed to
Dynamo without AOTAutograd's runtime wrapper (setting `direct_inference`, on by default), then through it:
the partitioned graph called as a plain function (`direct_call`) with each partition's generated glue
(torch_partition.CompiledPartition._compile_glue), the plain function without the generated glue, and
neither (the FX GraphModule and the interpreted glue); timed in alternation: per round, 3000 calls each,
microseconds per call; the table gives the median over rounds. Then a 16-input plan called directly, with the
input check's C++ guard (runtime/guards.FastInputCheck) and with the Python checks alone.

    PYTHONPATH=src python bench/host_call_cpu.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FUSEGRAPH_USE_TRITON", "0")   # kernels through the torch reference: host time only

import torch

import fusegraph as fg
from fusegraph.settings import override


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    from fusegraph.frontends.torch_partition import CompiledPartition

    # (direct_call setting, the partitions' generated glue): the glue is turned off by building with
    # CompiledPartition._compile_glue patched to give none (then forward interprets `_run`)
    # (direct_call, glue, direct_inference: no AOTAutograd runtime wrapper)
    variants = {"no AOT wrapper": (True, True, True), "direct call + glue": (True, True, False),
                "direct call only": (True, False, False), "neither": (False, False, False)}
    compiled = {}
    original = CompiledPartition._compile_glue
    for name, (direct, glue, no_wrapper) in variants.items():
        try:
            if not glue:
                CompiledPartition._compile_glue = lambda self: None  # type: ignore[method-assign]
            with override(direct_call=direct, direct_inference=no_wrapper), torch.no_grad():
                fn = fg.compile(model)
                fn(x)   # compiles under this variant's settings
        finally:
            CompiledPartition._compile_glue = original  # type: ignore[method-assign]
        compiled[name] = fn
        assert [g.direct for g in fn.fusegraph_report.graphs] == [no_wrapper], name   # its own compile
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in compiled.items():
                for _ in range(10):
                    fn(x)
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    for name, samples in times.items():
        print(f"{name:18s} {statistics.median(samples):7.1f} us per call (rounds: "
              f"{', '.join(f'{t:.1f}' for t in samples)})")
    input_checks(args.rounds, args.calls)


def input_checks(rounds: int, calls: int) -> None:
    """The input check alone of a plan of 16 inputs (the head of its per-call function, runtime/plan.py
    _guard_source, run up to where the kernels would start): with its C++ guard armed
    (runtime/guards.FastInputCheck) and with the Python checks alone, in alternation."""
    from fusegraph.runtime.guards import FastInputCheck

    g = fg.Graph(name="sixteen_inputs")
    handles = [g.tensor((4, 8), dtype="float32", name=f"x{i}") for i in range(16)]
    total = handles[0]
    for h in handles[1:]:
        total = g.add(total, h)
    total.set_output()
    plan = g.build(device="cpu")
    xs = [torch.randn(4, 8) for _ in handles]
    plan(*xs)   # arms the C++ guard
    lines, env = plan._guard_source()
    env = dict(env)
    exec(compile("\n".join([*lines, "    return None"]), "<input checks>", "exec"), env)
    check_only = env["run"]
    armed = plan._fast_check.check
    times: dict[str, list[float]] = {"C++ guard": [], "Python checks": []}
    for _ in range(rounds):
        for name, check in (("C++ guard", armed), ("Python checks", FastInputCheck._never)):
            plan._fast_check.check = check
            start = time.perf_counter()
            for _ in range(calls):
                check_only(xs)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    plan._fast_check.check = armed
    for name, samples in times.items():
        print(f"input checks of a 16-input plan, {name:14s} {statistics.median(samples):6.2f} us per call")


if __name__ == "__main__":
    main()
