"""The cuDNN-style Graph API: describe the whole graph, then validate, build, execute.

A thin face over the IR: argument checking and naming only. Op methods come from the op
modules (fusegraph.ops.*Methods), each next to the op's registry entry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import GraphError, where
from .ir import dtypes
from .ir.emit import Emitter, user_source_line
from .ir.graph import Graph as IRGraph
from .ir.node import Attrs, Node
from .ir.spec import TensorSpec
from .ops import OP_METHODS


class Tensor:
    """A handle to a value in a Graph under construction."""

    __slots__ = ("graph", "node")

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph = graph
        self.node = node

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> str:
        return self.node.dtype

    @property
    def spec(self) -> TensorSpec:
        return self.node.spec

    def set_output(self) -> Tensor:
        self.graph.set_output(self)
        return self

    def __repr__(self) -> str:
        return f"Tensor({self.name}: {self.node.spec})"

    # Operators: a + b is g.add(a, b), and so on.
    def __add__(self, o: Any) -> Tensor: return self.graph.add(self, o)
    def __radd__(self, o: Any) -> Tensor: return self.graph.add(o, self)
    def __sub__(self, o: Any) -> Tensor: return self.graph.sub(self, o)
    def __rsub__(self, o: Any) -> Tensor: return self.graph.sub(o, self)
    def __mul__(self, o: Any) -> Tensor: return self.graph.mul(self, o)
    def __rmul__(self, o: Any) -> Tensor: return self.graph.mul(o, self)
    def __truediv__(self, o: Any) -> Tensor: return self.graph.div(self, o)
    def __rtruediv__(self, o: Any) -> Tensor: return self.graph.div(o, self)
    def __neg__(self) -> Tensor: return self.graph.neg(self)

    __hash__ = object.__hash__


class Graph(*OP_METHODS):  # type: ignore[misc]
    """fg.Graph(name, compute_dtype): the builder. Every op method returns a Tensor handle."""

    def __init__(self, name: str = "graph", compute_dtype: str = "float32") -> None:
        self.name = name
        self.compute_dtype = dtypes.canonical(compute_dtype)
        self._emit = Emitter()
        self._inputs: list[Node] = []
        self._outputs: list[Node] = []
        self._handles: dict[int, Tensor] = {}
        self._names: set[str] = set()
        self._device_hint: str | None = None

    # ---- inputs ----
    def tensor(self, shape: Sequence[int], dtype: Any = "float32", name: str | None = None,
               layout: str | None = None, strides: Sequence[int] | None = None,
               device: str | None = None) -> Tensor:
        """Declare a graph input."""
        source = user_source_line()
        name = name or f"in{len(self._inputs)}"
        if name in self._names:
            raise GraphError(f"{where('input', name, source)}: the name {name!r} is already used in graph "
                             f"{self.name}")
        if any((not isinstance(s, int)) or s < 0 for s in shape):
            from .errors import ShapeError
            raise ShapeError(f"{where('input', name, source)}: shape {tuple(shape)} must be non-negative ints")
        spec = TensorSpec(tuple(shape), dtypes.canonical(dtype), layout=layout,
                          strides=tuple(strides) if strides is not None else None, device=device)
        node = Node(op="input", inputs=(), attrs=Attrs(index=len(self._inputs)), specs=(spec,), name=name,
                    source=source)
        self._names.add(name)
        self._inputs.append(node)
        return self._handle(node)

    def tensor_like(self, t: torch.Tensor, name: str | None = None) -> Tensor:
        """Declare an input with the shape, dtype and device of a torch tensor."""
        layout = "NHWC" if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
            and not t.is_contiguous() else None
        handle = self.tensor(tuple(t.shape), dtypes.canonical(t.dtype), name=name, layout=layout,
                             device=t.device.type)
        self._device_hint = self._device_hint or t.device.type
        return handle

    def constant(self, value: torch.Tensor | float | int, name: str | None = None) -> Tensor:
        """A value known when the graph is built (folded into kernels where possible)."""
        if isinstance(value, torch.Tensor):
            spec = TensorSpec(tuple(value.shape), dtypes.canonical(value.dtype))
            node = Node(op="constant", inputs=(), attrs=Attrs(value=value.detach().clone()), specs=(spec,),
                        name=name or self._emit.fresh_name("const"), source=user_source_line())
            return self._handle(node)
        dtype = "float32" if isinstance(value, float) else ("bool" if isinstance(value, bool) else "int64")
        return self._handle(self._emit.scalar(value, dtype))

    # ---- ops ----
    def _node_of(self, value: Any, op: str) -> Any:
        if isinstance(value, Tensor):
            if value.graph is not self:
                raise GraphError(f"op {op}: tensor '{value.name}' belongs to graph '{value.graph.name}', "
                                 f"not to graph '{self.name}' (created at {user_source_line()})")
            return value.node
        if isinstance(value, bool | int | float):
            return value
        if isinstance(value, torch.Tensor):
            raise GraphError(f"op {op}: got a torch.Tensor; declare it with g.tensor_like(t) or g.constant(t) "
                             f"(at {user_source_line()})")
        raise GraphError(f"op {op}: unsupported operand of type {type(value).__name__} "
                         f"(at {user_source_line()})")

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        nodes = [self._node_of(o, op) for o in operands]
        if name is not None and name in self._names:
            raise GraphError(f"{where(op, name, user_source_line())}: the name {name!r} is already used")
        out = self._emit.op(op, *nodes, _name=name, **attrs)
        if isinstance(out, tuple):
            return tuple(self._handle(n) for n in out)
        return self._handle(out)

    def _handle(self, node: Node) -> Tensor:
        self._names.add(node.name)
        handle = Tensor(self, node)
        self._handles[node.id] = handle
        return handle

    # ---- outputs, validate, build ----
    def set_output(self, *tensors: Tensor) -> None:
        for t in tensors:
            node = self._node_of(t, "set_output")
            if not isinstance(node, Node):
                raise GraphError(f"set_output takes tensors of this graph, got {node!r}")
            if node not in self._outputs:
                self._outputs.append(node)

    def inputs(self) -> list[Tensor]:
        return [self._handles[n.id] for n in self._inputs]

    def output_handles(self) -> list[Tensor]:
        return [self._handles[n.id] for n in self._outputs]

    def to_ir(self) -> IRGraph:
        if not self._outputs:
            raise GraphError(f"graph {self.name} has no outputs: call t.set_output() on the tensors "
                             "to compute")
        return IRGraph(self.name, tuple(self._inputs), tuple(self._outputs), self.compute_dtype)

    def validate(self) -> Graph:
        """Check the whole graph (structure, shapes, dtypes); raises a FusegraphError subclass."""
        from .ir.verify import verify

        verify(self.to_ir())
        return self

    def build(self, device: str | None = None, **options: Any) -> Any:
        """Optimize, fuse, generate and tune; returns a runnable Plan."""
        from .compiler import compile_graph

        self.validate()
        return compile_graph(self.to_ir(), device=device or self._device_hint,
                             input_handles=self.inputs(), output_handles=self.output_handles(), **options)

    def __str__(self) -> str:
        if not self._outputs:
            return f"graph {self.name} (no outputs yet)"
        return str(self.to_ir())
