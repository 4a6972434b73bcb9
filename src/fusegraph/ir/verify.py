"""The IR verifier: checks a graph's invariants. Runs between passes when FUSEGRAPH_VERIFY or
FUSEGRAPH_DEBUG is set, and in tests."""

from __future__ import annotations

from ..errors import GraphError, where
from .graph import Graph
from .node import Attrs
from .registry import SOURCE, get_op


def verify(graph: Graph, after: str = "") -> None:
    ctx = f" after pass {after}" if after else ""
    if not graph.outputs:
        raise GraphError(f"graph {graph.name} has no outputs{ctx}; call set_output() on a tensor")
    seen: set[int] = set()
    input_ids = {n.id for n in graph.inputs}
    for node in graph.nodes:
        opdef = get_op(node.op)
        for i in node.inputs:
            if i.id not in seen:
                raise GraphError(f"{where(node.op, node.name, node.source)}{ctx}: input '{i.name}' "
                                 "is not computed before it (not in topological order, or foreign)")
        if node.op == "input" and node.id not in input_ids:
            raise GraphError(f"input '{node.name}'{ctx} is used but is not an input of graph {graph.name}")
        if not opdef.has(SOURCE) and node.op != "getitem":
            out = opdef.infer([i.spec for i in node.inputs], node.attrs)
            specs = out if isinstance(out, tuple) else (out,)
            got = tuple((s.shape, s.dtype) for s in node.specs)
            want = tuple((s.shape, s.dtype) for s in specs)
            if got != want:
                raise GraphError(f"{where(node.op, node.name, node.source)}{ctx}: recorded specs {got} "
                                 f"differ from inferred {want}")
        if not isinstance(node.attrs, Attrs):
            raise GraphError(f"{where(node.op, node.name, node.source)}{ctx}: attrs are not frozen")
        seen.add(node.id)
    for n in graph.inputs:
        seen.add(n.id)
    for res in graph.outputs:
        if res.id not in seen:
            raise GraphError(f"output '{res.name}' of graph {graph.name}{ctx} is not computed")
