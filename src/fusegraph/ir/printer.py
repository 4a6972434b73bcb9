"""Readable text for every stage: graphs (one line per node) and plans (launch list)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import Graph


def format_node(node: Any) -> str:
    specs = ", ".join(str(s) for s in node.specs)
    args = ", ".join(i.name for i in node.inputs)
    attrs = repr(node.attrs)
    call = f"{node.op}({args}{', ' if args and attrs else ''}{attrs})"
    src = f"  # {node.source}" if node.source else ""
    return f"{node.name}: {specs} = {call}{src}"


def format_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} (compute {graph.compute_dtype}):"]
    for record in graph.provenance:
        lines.append(f"  # {record}")
    ins = ", ".join(f"{n.name}: {n.spec}" for n in graph.inputs)
    lines.append(f"  inputs: {ins}")
    for node in graph.nodes:
        if node.op != "input":
            lines.append("  " + format_node(node))
    lines.append(f"  outputs: {', '.join(n.name for n in graph.outputs)}")
    return "\n".join(lines)


def format_plan(plan: Any) -> str:
    lines = [f"plan for {plan.graph.name} on {plan.device}: {len(plan.kernels)} kernel(s)"]
    for k, kernel in enumerate(plan.kernels):
        reads = ", ".join(n.name for n in kernel.inputs)
        writes = ", ".join(n.name for n in kernel.outputs)
        lines.append(f"  [{k}] {kernel.name} ({kernel.kind}, {kernel.backend}): "
                     f"{len(kernel.nodes)} op(s) {'+'.join(kernel.ops[:8])}{'...' if len(kernel.ops) > 8 else ''}")
        lines.append(f"      reads {reads or '-'}; writes {writes or '-'}; "
                     f"{kernel.cost.bytes:,} B, {kernel.cost.flops:,} FLOP")
    return "\n".join(lines)
