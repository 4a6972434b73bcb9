"""The IR graph: an immutable DAG of Nodes with inputs, outputs and provenance."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import GraphError, where
from .node import Node


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int

    def __str__(self) -> str:
        return (f"constructed by {self.name} (took {self.seconds * 1e3:.2f} ms, "
                f"{self.nodes_before} -> {self.nodes_after} nodes)")


def topological_order(outputs: Iterable[Node], extra: Iterable[Node] = ()) -> tuple[Node, ...]:
    """Nodes reachable from `outputs` (and `extra`), each after its inputs. Raises on cycles."""
    order: list[Node] = []
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    for root in list(extra) + list(outputs):
        if state.get(root.id) == 2:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        state[root.id] = 1
        while stack:
            node, i = stack[-1]
            if i < len(node.inputs):
                stack[-1] = (node, i + 1)
                child = node.inputs[i]
                s = state.get(child.id)
                if s == 1:
                    path = " -> ".join(n.name for n, _ in stack[[n.id for n, _ in stack].index(child.id):])
                    raise GraphError(f"{where(child.op, child.name, child.source)}: is part of a cycle "
                                     f"({path} -> {child.name}); a graph must be acyclic")
                if s is None:
                    state[child.id] = 1
                    stack.append((child, 0))
            else:
                stack.pop()
                state[node.id] = 2
                order.append(node)
    return tuple(order)


@dataclass(frozen=True)
class Graph:
    """A whole computation. Passes take a Graph and return a new one; nothing here mutates."""

    name: str
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    compute_dtype: str = "float32"
    provenance: tuple[PassRecord, ...] = ()
    order: tuple[Node, ...] | None = None  # an explicit topological order (from a scheduling pass)
    nodes: tuple[Node, ...] = field(init=False)

    def __post_init__(self) -> None:
        nodes = self.order if self.order is not None else topological_order(self.outputs, self.inputs)
        object.__setattr__(self, "nodes", nodes)

    def users(self) -> dict[int, list[Node]]:
        """node id -> the nodes that consume it (in order)."""
        users: dict[int, list[Node]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users.setdefault(i.id, []).append(n)
        return users

    def with_(self, *, outputs: tuple[Node, ...] | None = None, inputs: tuple[Node, ...] | None = None,
              record: PassRecord | None = None, order: tuple[Node, ...] | None = None) -> Graph:
        return Graph(
            name=self.name,
            inputs=self.inputs if inputs is None else inputs,
            outputs=self.outputs if outputs is None else outputs,
            compute_dtype=self.compute_dtype,
            provenance=self.provenance + ((record,) if record else ()),
            order=order,
        )

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)


def map_nodes(graph: Graph, fn: Callable[[Node], Node]) -> Graph:
    """Rewrite a graph node by node, inputs first: the common tool of passes.

    `fn` sees each node with its inputs already rewritten and returns the node to use in its
    place (itself, a new node, or an existing one). Inputs of the graph are kept as they are.
    """
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        new_inputs = tuple(mapping[i.id] for i in node.inputs)
        changed = any(a is not b for a, b in zip(new_inputs, node.inputs, strict=True))
        candidate = node.replace(inputs=new_inputs) if changed else node
        mapping[node.id] = fn(candidate)
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))
