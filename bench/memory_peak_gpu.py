"""Peak memory of eager, torch.compile and fusegraph, beside the planned peak of fusegraph's Plans.

    PYTHONPATH=src python bench/memory_peak_gpu.py               # H200: ~2 minutes
    PYTHONPATH=src python bench/memory_peak_gpu.py --cpu-smoke   # CPU: the planner's numbers only

Workloads: the demo transformer block (fusegraph.commands.demo_blocks; built through the Graph API
for fusegraph, and the same block as an nn.Module for torch.compile and fg.compile), an MLP and a
small conv net, each in inference (torch.no_grad) and one training step (forward, loss, backward).

Measured peak (GPU): after warm-up calls (compilation), torch.cuda.reset_peak_memory_stats(), one
call, torch.cuda.max_memory_allocated() minus torch.cuda.memory_allocated() before the call, so the
resident inputs and weights (and, for training, the gradients of the previous step, dropped with
grad = None before the call) are not counted; the returned output and the new gradients are.
Held: bytes still allocated after the warm-up calls beyond what was allocated before the first call
(what a compiled object keeps between calls: build-time constants, a captured CUDA graph's buffers).
For the Graph API block, "no inplace/graph" is the same Plan's kernels with in-place writes and CUDA
graphs off (the effect of the in-place choice on the measured peak).

Planned peak: every Plan fusegraph built for the workload reports plan.memory (runtime/memory.py):
the max over its launch schedule of live intermediates + outputs. A Plan's peak ignores what torch
keeps around it (AOTAutograd's saved activations between forward and backward, eager fallback
partitions), so for compiled models it is a per-graph figure, listed per Plan.

Writes memory_peak_{gpu,cpu_smoke}.json and .txt to $OUT (when set) and bench/results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # generated kernels run (and are planned in place)

import torch
import torch.nn as nn

import fusegraph as fg
from fusegraph.commands.demo_blocks import SIZES, TransformerSize, transformer_block
from fusegraph.runtime import plan as plan_module
from fusegraph.runtime.memory import fmt_bytes

# what every Plan built while a workload compiles reports: (graph name, kernels, plan.memory); the
# Plans themselves are not kept (their constants and CUDA-graph pools would stay allocated)
BUILT: list[tuple[str, int, Any]] = []


def _record_plans() -> None:
    init = plan_module.Plan.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        BUILT.append((self.graph.name, len(self.kernels), self.memory))

    plan_module.Plan.__init__ = recording_init  # type: ignore[method-assign]


class TransformerModule(nn.Module):
    """The demo block's eager function with its weights as parameters."""

    def __init__(self, size: TransformerSize, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        block = transformer_block(size, dtype, device)
        self.fn = block.eager
        self.weights = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in block.named_tensors.items()
                                         if k != "x"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn({"x": x, **dict(self.weights.items())})


def mlp(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, dim), nn.LayerNorm(dim))


class ConvNet(nn.Module):
    def __init__(self, channels: int, classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_input: Callable[[], torch.Tensor]
    dtype: torch.dtype


def workloads(device: str, smoke: bool) -> list[Workload]:
    size = SIZES["small"][0] if smoke else SIZES["medium"][0]
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    tb_dtype = torch.float32 if smoke else torch.bfloat16
    b, s, d = size.batch, size.seq, size.dim
    mlp_rows, mlp_dim, mlp_hidden = (64, 32, 128) if smoke else (8192, 1024, 4096)
    conv_batch, conv_c, conv_hw = (2, 8, 8) if smoke else (64, 64, 56)
    return [
        Workload("transformer_block", lambda: TransformerModule(size, tb_dtype, device),
                 lambda: rnd(b, s, d, dtype=tb_dtype), tb_dtype),
        Workload("mlp", lambda: mlp(mlp_dim, mlp_hidden).to(device), lambda: rnd(mlp_rows, mlp_dim), torch.float32),
        Workload("convnet", lambda: ConvNet(conv_c).to(device).to(memory_format=torch.channels_last),  # type: ignore[call-overload]
                 lambda: rnd(conv_batch, 3, conv_hw, conv_hw).contiguous(memory_format=torch.channels_last),
                 torch.float32),
    ]


def measure(fn: Callable[[], Any], device: str, prepare: Callable[[], None] = lambda: None,
            warmup: int = 2) -> tuple[int | None, int | None]:
    """(peak, held) on the GPU: peak = bytes allocated at most during one call beyond what was
    allocated before it; held = bytes the compiled object keeps allocated between calls (constants,
    CUDA-graph buffers), taken after the warm-up calls. (None, None) on the CPU."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
    start = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(warmup):
        prepare()
        out = fn()
        del out
    if not cuda:
        return None, None
    prepare()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return int(peak), int(before - start)


def step_fn(model: Any, x: torch.Tensor, train: bool) -> tuple[Callable[[], Any], Callable[[], None]]:
    """The call to measure and what runs before it (training: drop the previous step's gradients)."""
    if not train:
        def infer() -> Any:
            with torch.no_grad():
                return model(x)
        return infer, lambda: None

    def drop_grads() -> None:
        for p in model.parameters():
            p.grad = None

    def train_step() -> Any:
        out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        return loss.detach()
    return train_step, drop_grads


def plans_summary(plans: list[tuple[str, int, Any]]) -> list[dict[str, Any]]:
    return [{"graph": name, "kernels": kernels, **memory.as_dict()} for name, kernels, memory in plans]


def run_variant(w: Workload, variant: str, train: bool, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model: Any = w.make_model()
    if not train:
        model.eval()
    x = w.make_input()
    if variant == "torch.compile":
        model = torch.compile(model)
    elif variant == "fusegraph":
        model = fg.compile(model)
    first = len(BUILT)
    t0 = time.perf_counter()
    fn, prepare = step_fn(model, x, train)
    peak, held = measure(fn, device, prepare)
    plans = BUILT[first:]
    row: dict[str, Any] = {"workload": w.name, "mode": "train" if train else "infer", "variant": variant,
                           "measured_peak_bytes": peak, "held_bytes": held,
                           "seconds": round(time.perf_counter() - t0, 2)}
    if variant == "fusegraph":
        row["plans"] = plans_summary(plans)
        row["planned_peak_bytes"] = max((memory.peak_live_bytes for _, _, memory in plans), default=0)
    return row


def graph_api_block(device: str, smoke: bool) -> dict[str, Any]:
    """The demo transformer block built through the Graph API (one Plan), inference."""
    size = SIZES["small"][0] if smoke else SIZES["medium"][0]
    dtype = torch.float32 if smoke else torch.bfloat16
    block = transformer_block(size, dtype, device)
    plan = block.graph.build(device=device)
    plain = plan_module.Plan(plan.graph, plan.kernels, plan.device, inplace=False, cuda_graphs=False)
    tensors = list(block.feeds.values())
    named = block.named_tensors
    peak, held = measure(lambda: plan(*tensors), device)
    plain_peak, _ = measure(lambda: plain(*tensors), device)
    with torch.no_grad():
        eager_peak, _ = measure(lambda: block.eager(named), device)
        compiled = torch.compile(block.eager)
        compiled_peak, _ = measure(lambda: compiled(named), device) if not smoke else (None, None)
    return {"workload": "transformer_block (Graph API)", "mode": "infer", "variant": "fusegraph plan",
            "measured_peak_bytes": peak, "held_bytes": held, "cuda_graph": plan.cuda_graph_note,
            "no_inplace_no_graph_peak_bytes": plain_peak, "eager_peak_bytes": eager_peak,
            "torch_compile_peak_bytes": compiled_peak, "planned_peak_bytes": plan.memory.peak_live_bytes,
            "plans": plans_summary([(plan.graph.name, len(plan.kernels), plan.memory)]),
            "memory": plan.memory.summary()}


def planned_demo_blocks() -> list[dict[str, Any]]:
    """The planner on the GPU-sized (medium, bf16) demo blocks, built on the CPU and not run."""
    from fusegraph.commands.demo_blocks import conv_block

    rows = []
    transformer_size, conv_size = SIZES["medium"]
    for block in (transformer_block(transformer_size, torch.bfloat16, "cpu"),
                  conv_block(conv_size, torch.bfloat16, "cpu")):
        plan = block.graph.build(device="cpu")
        rows.append({"workload": block.description, "kernels": len(plan.kernels), **plan.memory.as_dict(),
                     "memory": plan.memory.summary()})
    return rows


def _mb(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def to_text(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, f"{'workload':<30} {'mode':<6} {'variant':<15} {'measured peak':>14} {'planned peak':>13} "
                     f"{'held':>11}"]
    for r in rows:
        lines.append(f"{r['workload']:<30} {r['mode']:<6} {r['variant']:<15} {_mb(r['measured_peak_bytes']):>14} "
                     f"{_mb(r.get('planned_peak_bytes')):>13} {_mb(r.get('held_bytes')):>11}")
        if "eager_peak_bytes" in r:
            lines.append(f"{'':<30} {'':<6} {'no inplace/graph':<15} {_mb(r['no_inplace_no_graph_peak_bytes']):>14}")
            lines.append(f"{'':<30} {'':<6} {'eager':<15} {_mb(r['eager_peak_bytes']):>14}")
            lines.append(f"{'':<30} {'':<6} {'torch.compile':<15} {_mb(r['torch_compile_peak_bytes']):>14}")
        for p in r.get("plans", []):
            lines.append(f"{'':<8}plan {p['graph'][:24]:<24} {p['kernels']:>3} kernels: "
                         f"arena {fmt_bytes(p['arena_bytes'])} (no reuse {fmt_bytes(p['no_reuse_bytes'])}, "
                         f"{p['num_buffers']} buffers, {p['reused']} reused, {p['inplace']} in place), "
                         f"planned peak {fmt_bytes(p['peak_live_bytes'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny shapes: the planner's numbers only")
    parser.add_argument("--only", default="", help="comma-separated workload names")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    warnings.simplefilter("ignore")
    _record_plans()
    rows = [graph_api_block(device, smoke)]
    variants = ["eager", "fusegraph"] if smoke else ["eager", "torch.compile", "fusegraph"]
    for w in workloads(device, smoke):
        if args.only and w.name not in args.only.split(","):
            continue
        for train in (False, True):
            for variant in variants:
                try:
                    rows.append(run_variant(w, variant, train, device))
                except Exception as err:  # one failure must not hide the other numbers
                    rows.append({"workload": w.name, "mode": "train" if train else "infer", "variant": variant,
                                 "measured_peak_bytes": None, "error": f"{type(err).__name__}: {err}"[:300]})
                torch._dynamo.reset()
                gc.collect()
    planned = planned_demo_blocks() if smoke else []
    tag = "cpu_smoke" if smoke else "gpu"
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    header = (f"memory peak ({tag}, {dev_name}, torch {torch.__version__}); measured = max_memory_allocated "
              f"during one call minus memory allocated before it" + ("; CPU: planner only" if smoke else ""))
    text = to_text(rows, header)
    if planned:
        text += "\nplanner only, GPU-sized demo blocks (bf16, built on the CPU, not run):"
        for r in planned:
            text += f"\n  {r['workload']}: {r['kernels']} kernels\n    {r['memory']}"
    errors = [f"{r['workload']} {r['mode']} {r['variant']}: {r['error']}" for r in rows if "error" in r]
    if errors:
        text += "\nerrors:\n" + "\n".join(errors)
    print(text)
    payload = {"device": dev_name, "torch": torch.__version__, "rows": rows, "planned_demo_blocks": planned}
    targets = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    if os.environ.get("OUT"):
        targets.append(os.environ["OUT"])
    for folder in targets:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"memory_peak_{tag}.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(folder, f"memory_peak_{tag}.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
