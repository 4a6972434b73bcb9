"""The cuDNN-style Graph API: describe the whole graph, then validate, build, execute.

A thin face over the IR: argument checking and naming only. Op methods come from the op
modules (fusegraph.ops.*Methods), each next to the op's registry entry."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .errors import FusegraphError, GraphError, ShapeError, where
from .ir import dtypes
from .ir.emit import Emitter, user_source_line
from .ir.graph import Graph as IRGraph
from .ir.node import Attrs, Node
from .ir.spec import LAYOUTS, TensorSpec
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
    def __pow__(self, o: Any) -> Tensor: return self.graph.pow(self, o)
    def __rpow__(self, o: Any) -> Tensor: return self.graph.pow(o, self)
    def __matmul__(self, o: Any) -> Tensor: return self.graph.matmul(self, o)

    def __bool__(self) -> bool:
        raise GraphError(f"{where(self.node.op, self.name, user_source_line())}: a graph tensor has no value "
                         "while the graph is built, so it is neither true nor false; use g.where(cond, a, b) "
                         "for a choice made per element")

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
        self._static_inputs: set[int] = set()   # input positions declared static=True

    @contextlib.contextmanager
    def source_at(self, line: str | None) -> Iterator[None]:
        """Ops added inside are attributed to `line` ("file:line", shown in dumps and errors) instead of
        the innermost caller outside fusegraph: what a frontend uses to point at the model's own code
        (the torch frontend: each FX node's traced line). None keeps the caller's line."""
        if line is None:
            yield
            return
        previous = self._emit.source
        self._emit.source = line
        try:
            yield
        finally:
            self._emit.source = previous

    # ---- inputs ----
    def tensor(self, shape: Sequence[int], dtype: Any = "float32", name: str | None = None,
               layout: str | None = None, strides: Sequence[int] | None = None,
               device: str | None = None, static: bool = False) -> Tensor:
        """Declare a graph input. static=True: a parameter (a weight) that is the same tensor at every
        call; a plan replayed as a CUDA graph reads it in place instead of copying it each call (a call
        with another tensor there still works, kernel by kernel; runtime/cuda_graph.py)."""
        source = user_source_line()
        name = self._claim_name(name, "in", "input", source, start=len(self._inputs))
        label = where("input", name, source)
        spec = _input_spec(label, shape, dtype, layout, strides, device)
        node = Node(op="input", inputs=(), attrs=Attrs(index=len(self._inputs)), specs=(spec,), name=name,
                    source=source)
        if static:
            self._static_inputs.add(len(self._inputs))
        self._inputs.append(node)
        return self._handle(node)

    def tensor_like(self, t: torch.Tensor, name: str | None = None, static: bool = False) -> Tensor:
        """Declare an input with the shape, dtype and device of a torch tensor (static: as in tensor())."""
        if not isinstance(t, torch.Tensor):
            raise GraphError(f"{where('input', name or '?', user_source_line())}: tensor_like takes a "
                             f"torch.Tensor, got {type(t).__name__}")
        layout = "NHWC" if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
            and not t.is_contiguous() else None
        handle = self.tensor(tuple(t.shape), dtypes.canonical(t.dtype), name=name, layout=layout,
                             device=t.device.type, static=static)
        self._device_hint = self._device_hint or t.device.type
        return handle

    def constant(self, value: torch.Tensor | float | int, name: str | None = None) -> Tensor:
        """A value known when the graph is built (folded into kernels where possible). A tensor is
        copied, so changing it later does not change the graph."""
        source = user_source_line()
        if isinstance(value, torch.Tensor):
            name = self._claim_name(name, "const", "constant", source)
            try:
                dtype = dtypes.canonical(value.dtype)
            except FusegraphError as err:
                raise type(err)(f"{where('constant', name, source)}: {err}") from None
            spec = TensorSpec(tuple(value.shape), dtype)
            node = Node(op="constant", inputs=(), attrs=Attrs(value=value.detach().clone()), specs=(spec,),
                        name=name, source=source)
            return self._handle(node)
        if not isinstance(value, bool | int | float):
            raise GraphError(f"{where('constant', name or '?', source)}: a constant is a torch.Tensor or a "
                             f"Python number, got {type(value).__name__}")
        dtype = "float32" if isinstance(value, float) else ("bool" if isinstance(value, bool) else "int64")
        name = self._claim_name(name, "scalar", "scalar", source)
        node = Node(op="scalar", inputs=(), attrs=Attrs(value=value), specs=(TensorSpec((), dtype),), name=name,
                    source=source)
        return self._handle(node)

    # ---- ops ----
    def _node_of(self, value: Any, op: str, label: str | None = None) -> Any:
        """The IR node of an operand (Python numbers pass through); GraphError for anything else."""
        label = label or f"op {op} (at {user_source_line()})"
        if isinstance(value, Tensor):
            if value.graph is not self:
                raise GraphError(f"{label}: tensor '{value.name}' (op {value.node.op}, created at "
                                 f"{value.node.source or '?'}) belongs to graph '{value.graph.name}', "
                                 f"not to graph '{self.name}'")
            return value.node
        if isinstance(value, bool | int | float):
            return value
        if isinstance(value, torch.Tensor):
            raise GraphError(f"{label}: got a torch.Tensor {tuple(value.shape)} {value.dtype}; declare it with "
                             "g.tensor_like(t) or g.constant(t)")
        raise GraphError(f"{label}: unsupported operand of type {type(value).__name__}: {value!r:.60}")

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        source = self._emit.source or user_source_line()
        node_name = self._claim_name(name, op, op, source)
        label = where(op, node_name, source)
        nodes = [self._node_of(o, op, label) for o in operands]
        out = self._emit.op(op, *nodes, _name=node_name, **attrs)
        if isinstance(out, tuple):
            return tuple(self._handle(n) for n in out)
        return self._handle(out)

    def _claim_name(self, name: str | None, hint: str, op: str, source: str, start: int | None = None) -> str:
        """`name` if it is free (GraphError if taken), or a fresh automatic name."""
        if name is not None:
            if not isinstance(name, str) or not name:
                raise GraphError(f"{where(op, str(name), source)}: a name must be a non-empty string")
            if name in self._names:
                raise GraphError(f"{where(op, name, source)}: the name {name!r} is already used in graph "
                                 f"{self.name}")
            self._names.add(name)
            return name
        while True:
            fresh = f"{hint}{start}" if start is not None else self._emit.fresh_name(hint)
            start = None if start is None else start + 1
            if fresh not in self._names:
                self._names.add(fresh)
                return fresh

    def _handle(self, node: Node) -> Tensor:
        self._names.add(node.name)
        handle = Tensor(self, node)
        self._handles[node.id] = handle
        return handle

    # ---- outputs, validate, build ----
    def set_output(self, *tensors: Tensor) -> None:
        """Mark tensors as outputs (in this order; a tensor marked twice counts once)."""
        source = user_source_line()
        for t in tensors:
            if not isinstance(t, Tensor):
                raise GraphError(f"set_output (at {source}): takes tensors of graph '{self.name}', got "
                                 f"{type(t).__name__}: {t!r:.60}")
            node = self._node_of(t, "set_output", f"set_output (at {source})")
            if node not in self._outputs:
                self._outputs.append(node)

    def inputs(self) -> list[Tensor]:
        return [self._handles[n.id] for n in self._inputs]

    def output_handles(self) -> list[Tensor]:
        return [self._handles[n.id] for n in self._outputs]

    def to_ir(self) -> IRGraph:
        if not self._outputs:
            raise GraphError(f"graph {self.name} has no outputs (at {user_source_line()}): call "
                             "t.set_output() on the tensors to compute")
        return IRGraph(self.name, tuple(self._inputs), tuple(self._outputs), self.compute_dtype)

    def validate(self) -> Graph:
        """Check the whole graph (structure, shapes, dtypes); raises a FusegraphError subclass."""
        from .ir.verify import verify

        verify(self.to_ir())
        return self

    def build(self, device: str | None = None, **options: Any) -> Any:
        """Optimize, fuse, generate and tune; returns a runnable Plan.

        Options (compiler.compile_graph lists them all) include cuda_graphs=True|False|None: replay the
        plan as one captured CUDA graph (None, the default: automatically when that is estimated to be
        faster; plan.cuda_graph_note says what was decided and why) and graph_outputs="copy"|"alias"|"reuse"
        ("alias": the graph's output buffers are returned as they are, valid until the next call;
        "reuse": returned while the previous call's are no longer referenced, see runtime/cuda_graph.py), and
        static_inputs=[handle, ...]: more inputs to treat as declared with static=True."""
        from .compiler import compile_graph

        self.validate()
        options["static_inputs"] = self._static_positions(options.get("static_inputs", ()))
        return compile_graph(self.to_ir(), device=device or self._device_hint,
                             input_handles=self.inputs(), output_handles=self.output_handles(), **options)

    def _static_positions(self, handles: Any) -> list[int]:
        """Positions of the inputs declared static and of `handles` (input Tensors of this graph)."""
        positions = set(self._static_inputs)
        if isinstance(handles, Tensor):
            handles = [handles]
        for h in handles:
            if not isinstance(h, Tensor) or h.graph is not self or h.node.op != "input":
                raise GraphError(f"graph {self.name}: build(static_inputs=...) takes input tensors of this graph "
                                 f"(from g.tensor / g.tensor_like), got {h!r}")
            positions.add(h.node.attrs["index"])
        return sorted(positions)

    def __str__(self) -> str:
        if not self._outputs:
            return f"graph {self.name} (no outputs yet)"
        return str(self.to_ir())


def _input_spec(label: str, shape: Any, dtype: Any, layout: str | None, strides: Sequence[int] | None,
                device: str | None) -> TensorSpec:
    """The spec of a declared input, or ShapeError/DTypeError/GraphError naming the input."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        if isinstance(shape, str | bytes) or any(isinstance(s, bool) for s in shape):
            raise TypeError("not a shape")
        shape = tuple(operator.index(s) for s in shape)   # ints, numpy ints, a torch.Size
    except TypeError:
        raise ShapeError(f"{label}: shape {shape!r} must be a sequence of non-negative ints") from None
    if any(s < 0 for s in shape):
        raise ShapeError(f"{label}: shape {shape!r} must be a sequence of non-negative ints")
    try:
        dtype_name = dtypes.canonical(dtype)
    except FusegraphError as err:
        raise type(err)(f"{label}: {err}") from None
    if strides is not None and len(tuple(strides)) != len(shape):
        raise ShapeError(f"{label}: strides {tuple(strides)} do not match shape {tuple(shape)} (rank {len(shape)})")
    if layout is not None and layout != "strided" and (layout not in LAYOUTS or len(LAYOUTS[layout]) != len(shape)):
        known = ", ".join(f"{k} (rank {len(v)})" for k, v in LAYOUTS.items())
        raise ShapeError(f"{label}: layout {layout!r} does not fit shape {tuple(shape)}; known layouts: {known}")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise GraphError(f"{label}: device {device!r} is not a device: {err}") from None
    return TensorSpec(tuple(shape), dtype_name, layout=layout,
                      strides=tuple(strides) if strides is not None else None, device=device)
