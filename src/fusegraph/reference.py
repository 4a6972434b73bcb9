"""The reference executor: runs any graph op by op with torch, on any device. It defines what
every op means; every test compares against it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import ExecutionError, FusegraphError, where
from .ir import dtypes
from .ir.graph import Graph
from .ir.node import Node
from .ir.registry import NO_UPCAST, SOURCE, get_op
from .runtime.guards import check_inputs, resolve_feeds
from .runtime.plan import fresh_outputs


def run_node(node: Node, args: list[torch.Tensor], compute_dtype: str, device: torch.device | None) -> Any:
    """One node's value: inputs upcast to the compute dtype, result cast to the node's dtype(s)."""
    opdef = get_op(node.op)
    if node.op == "scalar":
        return torch.tensor(node.attrs["value"], dtype=dtypes.to_torch(node.dtype), device=device)
    if not opdef.has(NO_UPCAST):
        cd = dtypes.to_torch(compute_dtype)
        args = [a.to(cd) if a.is_floating_point() and a.element_size() < cd.itemsize else a for a in args]
    try:
        out = opdef.reference(args, node.attrs)
    except FusegraphError:
        raise
    except Exception as err:  # a torch error inside an op: name the node
        raise ExecutionError(f"{where(node.op, node.name, node.source)}: reference failed: {err}") from err
    if not node.inputs and device is not None and isinstance(out, torch.Tensor):
        out = out.to(device)  # generators (iota, rand_uniform) have no input to take a device from
    if node.multi_output:
        return tuple(o.to(dtypes.to_torch(s.dtype)) for o, s in zip(out, node.specs, strict=True))
    if node.op in ("getitem",):
        return out
    if opdef.has(SOURCE):
        return out.to(device=device) if device is not None else out
    return out.to(dtypes.to_torch(node.dtype))


def execute_graph(graph: Graph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    check_inputs(graph.inputs, inputs)
    device = inputs[0].device if inputs else None
    env: dict[int, Any] = {n.id: t for n, t in zip(graph.inputs, inputs, strict=True)}
    users = graph.users()
    keep = {n.id for n in graph.outputs}
    remaining = {n.id: len(users.get(n.id, ())) for n in graph.nodes}
    for node in graph.nodes:
        if node.id in env:
            continue
        args = [env[i.id] for i in node.inputs]
        env[node.id] = run_node(node, args, graph.compute_dtype, device)
        for i in node.inputs:  # free values nobody needs any more
            remaining[i.id] -= 1
            if remaining[i.id] == 0 and i.id not in keep and i.op != "input":
                env.pop(i.id, None)
    slot = {n.id: k for k, n in enumerate(graph.inputs)}
    for n in graph.nodes:
        slot.setdefault(n.id, len(slot))
    return fresh_outputs([env[n.id] for n in graph.outputs], [slot[n.id] for n in graph.outputs], len(graph.inputs))


class ReferenceExecutor:
    """`fg.reference(g)`: execute(dict) -> {output handle: tensor}; __call__(*tensors) -> outputs."""

    def __init__(self, graph: Any) -> None:
        self.handles_out = list(getattr(graph, "output_handles", lambda: [])())
        self.graph: Graph = graph.to_ir() if hasattr(graph, "to_ir") else graph

    def execute(self, feeds: Mapping[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        outs = execute_graph(self.graph, resolve_feeds(self.graph.inputs, feeds))
        keys = self.handles_out or list(self.graph.outputs)
        return dict(zip(keys, outs, strict=True))

    def __call__(self, *tensors: torch.Tensor) -> Any:
        outs = execute_graph(self.graph, list(tensors))
        return outs[0] if len(outs) == 1 else tuple(outs)


def reference(graph: Any) -> ReferenceExecutor:
    return ReferenceExecutor(graph)
