"""Readable text for every stage: graphs (one line per node) and plans (launch list)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import Graph


_INLINE_CONSTANT_ELEMENTS = 8  # constants up to this size print their values


def format_value(node: Any) -> str:
    """How a node appears as an argument: its name, or the literal value of a scalar."""
    if node.op == "scalar":
        return repr(node.attrs["value"])
    return str(node.name)


def format_constant(value: Any) -> str:
    if hasattr(value, "numel") and value.numel() <= _INLINE_CONSTANT_ELEMENTS:
        return repr(value.detach().cpu().tolist())
    if hasattr(value, "shape"):
        dims = "x".join(str(s) for s in value.shape)
        return f"<{str(value.dtype).replace('torch.', '')}[{dims}] on {value.device}>"
    return repr(value)


def format_node(node: Any) -> str:
    """One line: `name: type = op(args, attrs)  # user line`. Multi-output nodes show a tuple of
    types; their getitems read `name.k: type = name[k]`; constants show small values inline."""
    specs = ", ".join(str(s) for s in node.specs)
    if len(node.specs) != 1:
        specs = f"({specs})"
    if node.op == "getitem":
        call = f"{format_value(node.inputs[0])}[{node.attrs['index']}]"
    elif node.op == "constant":
        call = f"constant({format_constant(node.attrs['value'])})"
    elif node.op == "scalar":
        call = f"scalar({node.attrs['value']!r})"
    else:
        args = ", ".join(format_value(i) for i in node.inputs)
        attrs = repr(node.attrs)
        call = f"{node.op}({args}{', ' if args and attrs else ''}{attrs})"
    src = f"  # {node.source}" if node.source else ""
    return f"{node.name}: {specs} = {call}{src}"


def format_graph(graph: Graph) -> str:
    """The whole graph, readable top to bottom: provenance (which passes built it and how long
    each took), inputs, one line per node (scalars are written inline where used), outputs."""
    lines = [f"graph {graph.name} (compute {graph.compute_dtype}, {len(graph.nodes)} nodes):"]
    for record in graph.provenance:
        lines.append(f"  # {record}")
    ins = ", ".join(f"{n.name}: {n.spec}" for n in graph.inputs)
    lines.append(f"  inputs: {ins or '-'}")
    output_ids = {n.id for n in graph.outputs}
    for node in graph.nodes:
        if node.op == "input" or (node.op == "scalar" and node.id not in output_ids):
            continue
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
