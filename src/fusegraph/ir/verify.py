"""The IR verifier: checks a graph's invariants. Runs between passes when FUSEGRAPH_VERIFY or
FUSEGRAPH_DEBUG is set (passes/base.py), on every build, and in tests.

Invariants: the graph has outputs; its inputs are distinct `input` nodes and every `input` node
reached is one of them; node ids are unique; every node comes after its inputs; every op is
registered and gets an allowed number of inputs; multi-output nodes are read only through
`getitem` with an index in range; attributes are frozen; and each node's recorded output types
are what its op's shape/dtype rule infers from its inputs.
"""

from __future__ import annotations

from ..errors import FusegraphError, GraphError, where
from .graph import Graph
from .node import Attrs, Node
from .registry import SOURCE, get_op
from .spec import TensorSpec


def _at(node: Node, ctx: str) -> str:
    return f"{where(node.op, node.name, node.source)}{ctx}"


def verify(graph: Graph, after: str = "") -> None:
    """Raise GraphError naming the first broken invariant (and the pass that broke it)."""
    ctx = f" after pass {after}" if after else ""
    if not graph.outputs:
        raise GraphError(f"graph {graph.name} has no outputs{ctx}; call set_output() on a tensor")
    input_ids: set[int] = set()
    for node in graph.inputs:
        if node.op != "input":
            raise GraphError(f"{_at(node, ctx)}: graph {graph.name} lists it as an input, but only "
                             "'input' nodes can be graph inputs")
        if node.id in input_ids:
            raise GraphError(f"{_at(node, ctx)}: listed twice among the inputs of graph {graph.name}")
        input_ids.add(node.id)
    seen: set[int] = set()
    for node in graph.nodes:
        if node.id in seen:
            raise GraphError(f"{_at(node, ctx)}: node id {node.id} appears twice in graph {graph.name}")
        _verify_node(node, seen, input_ids, graph.name, ctx)
        seen.add(node.id)
    seen |= input_ids
    for res in graph.outputs:
        if res.id not in seen:
            raise GraphError(f"output '{res.name}' of graph {graph.name}{ctx} is not computed by the graph")
        if res.multi_output:
            raise GraphError(f"{_at(res, ctx)}: a multi-output node cannot be a graph output; select "
                             "one output with getitem")


def _verify_node(node: Node, seen: set[int], input_ids: set[int], graph_name: str, ctx: str) -> None:
    try:
        opdef = get_op(node.op)
    except FusegraphError as err:
        raise GraphError(f"{_at(node, ctx)}: {err}") from None
    if not node.specs or not all(isinstance(s, TensorSpec) for s in node.specs):
        raise GraphError(f"{_at(node, ctx)}: output specs {node.specs!r} are not a non-empty tuple of TensorSpec")
    if not isinstance(node.attrs, Attrs):
        raise GraphError(f"{_at(node, ctx)}: attrs are not frozen (got {type(node.attrs).__name__})")
    lo, hi = opdef.num_inputs
    if len(node.inputs) < lo or (hi >= 0 and len(node.inputs) > hi):
        raise GraphError(f"{_at(node, ctx)}: has {len(node.inputs)} inputs; op {node.op} takes "
                         f"{lo}..{hi if hi >= 0 else 'n'}")
    for i in node.inputs:
        if i.id not in seen:
            raise GraphError(f"{_at(node, ctx)}: input '{i.name}' (op {i.op}) is not computed before it "
                             "(not in topological order, or from another graph)")
        if i.multi_output and node.op != "getitem":
            raise GraphError(f"{_at(node, ctx)}: reads '{i.name}', which has {len(i.specs)} outputs, "
                             "directly; select one with getitem")
    if node.op == "input" and node.id not in input_ids:
        raise GraphError(f"{_at(node, ctx)}: an input node that is not an input of graph {graph_name} "
                         "(a tensor from another graph?)")
    if node.op == "getitem":
        _verify_getitem(node, ctx)
    elif not opdef.has(SOURCE):
        try:
            out = opdef.infer([i.spec for i in node.inputs], node.attrs)
        except FusegraphError as err:
            raise GraphError(f"{_at(node, ctx)}: its op's shape/dtype rule rejects its inputs: {err}") from None
        specs = out if isinstance(out, tuple) else (out,)
        got = tuple((s.shape, s.dtype) for s in node.specs)
        want = tuple((s.shape, s.dtype) for s in specs)
        if got != want:
            raise GraphError(f"{_at(node, ctx)}: recorded specs {got} differ from inferred {want}")


def _verify_getitem(node: Node, ctx: str) -> None:
    parent = node.inputs[0] if len(node.inputs) == 1 else None
    index = node.attrs.get("index")
    if parent is None or not parent.multi_output:
        raise GraphError(f"{_at(node, ctx)}: getitem must read one multi-output node")
    if not isinstance(index, int) or not 0 <= index < len(parent.specs):
        raise GraphError(f"{_at(node, ctx)}: index {index!r} is out of range for '{parent.name}' "
                         f"(op {parent.op}), which has {len(parent.specs)} outputs")
    want, got = parent.specs[index], node.spec
    if (got.shape, got.dtype) != (want.shape, want.dtype):
        raise GraphError(f"{_at(node, ctx)}: spec {got} differs from output {index} of '{parent.name}' ({want})")
