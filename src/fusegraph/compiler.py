"""build(): the whole compiler, one readable sequence. Graph -> passes -> lowering -> Plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .ir.graph import Graph
from .ir.verify import verify
from .lower import lower_reference
from .passes import optimize
from .runtime.plan import Plan
from .settings import settings


def default_device(hint: str | None = None) -> str:
    if hint:
        return str(hint)
    return "cuda" if torch.cuda.is_available() else "cpu"


def compile_graph(graph: Graph, device: str | None = None, input_handles: Sequence[Any] = (),
                  output_handles: Sequence[Any] = (), **options: Any) -> Plan:
    """Optimize and lower `graph` for `device`; returns a runnable Plan."""
    device = default_device(device)
    verify(graph)
    optimized = optimize(graph)
    kernels = lower_reference(optimized)
    plan = Plan(optimized, kernels, device, input_handles, output_handles)
    _dump(plan)
    return plan


def _dump(plan: Plan) -> None:
    if settings.debug >= 1:
        print(plan.graph)
    if settings.debug >= 2:
        print(plan)
    if settings.debug >= 3:
        for k in plan.kernels:
            print(f"# ---- {k.name} ----\n{k.source}")
    if settings.dump_dir:
        os.makedirs(settings.dump_dir, exist_ok=True)
        base = os.path.join(settings.dump_dir, plan.graph.name)
        with open(base + ".graph.txt", "w") as f:
            f.write(str(plan.graph) + "\n")
        with open(base + ".plan.txt", "w") as f:
            f.write(str(plan) + "\n")
        for k in plan.kernels:
            if k.backend == "triton":
                with open(f"{base}.{k.name}.py", "w") as f:
                    f.write(k.source)
