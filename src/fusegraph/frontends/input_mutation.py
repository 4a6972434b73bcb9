"""Graph inputs mutated by an inference graph (a static KV cache, a buffer updated with add_, slice
assignment into an input): written in place, inside the Plan where possible.

AOTAutograd functionalizes every in-place op. By default it then returns the new value of a mutated
input as an extra graph output and copies it into the input after the graph (a full clone of a KV
cache per decode step plus the copy back). With keep_inference_input_mutations=True (inference graphs
only; training graphs still return the new values) the graph itself ends with one
`aten.copy_(input, new_value)` per mutated input, and this module decides what becomes of each:

- Re-inplaced (`reinplace_input_mutations`): when the new value is a scatter into the input's old
  value (`index_copy(inp, ...)`, `index_put(inp, ..., accumulate=False)`, `slice_scatter(inp, ...)`),
  nothing else reads the input, the new value has the input's dtype, shape and strides, and the new
  value (or a view of it) is not a graph output, the scatter becomes its in-place ATen form
  (`index_copy_`, `index_put_`; a slice_scatter becomes an `index_put_` at a constant arange index)
  on the input itself and the copy_ is dropped: only the written rows move, and every reader of the
  new value reads the input's memory. The partition translator (torch_ops_scatter) turns these into
  the IR ops `index_copy_inplace` / `index_put_inplace` defined here, which write into a Plan input
  (the partition declares that input static, so a captured CUDA graph writes the caller's tensor,
  not a copy of it).
- Kept as a write-back: anything else (the input read elsewhere, e.g. its old value used after the
  update; `buf.add_(1)`; an accumulating index_put_; a nested slice assignment). The new value is
  computed by the graph and the copy_ runs in torch after everything else (`order_write_backs`
  moves it to the end of the partitioned graph, so no reader of the old value can come after it).

Why "nothing else reads the input" and not "every other reader comes before the update": a re-inplaced
scatter must be safe to run twice with the same inputs (a captured CUDA graph's warm-up runs the Plan
once more; a partition whose Plan fails at run time is run again by torch). A pure overwrite whose
values do not depend on the overwritten tensor is; one whose values were computed from the old value
(`cache[pos] = cache[pos] + x`) is not, and every other reader of the input that comes before the update
feeds the update's values.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..errors import ShapeError
from ..ir.node import Attrs
from ..ir.registry import NO_UPCAST, RANDOM, WRITES_INPUT, Cost, define
from ..ir.spec import TensorSpec

aten = torch.ops.aten

# in-place ATen ops this pass creates (and the partition translator accepts) -> the IR op
INPLACE_ATEN = {aten.index_copy_.default: "index_copy_inplace", aten.index_put_.default: "index_put_inplace"}
INPLACE_IR_OPS = frozenset(INPLACE_ATEN.values())
WRITE_BACK = aten.copy_.default

# views: a reader of one of these reads the tensor it views
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.permute.default, aten.transpose.int,
          aten.t.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.alias.default,
          aten.detach.default, aten.as_strided.default, aten.diagonal.default, aten.unfold.default}


def aot_autograd_options() -> dict[str, Any]:
    """Extra aot_autograd(...) keywords: keep inference graphs' input mutations in the graph
    (aten.copy_ at the end) when this torch's aot_module_simplified takes the option."""
    from torch._functorch.aot_autograd import aot_module_simplified

    if "keep_inference_input_mutations" in inspect.signature(aot_module_simplified).parameters:
        return {"keep_inference_input_mutations": True}
    return {}


@dataclass(frozen=True)
class Mutation:
    """One mutated graph input and what became of its update."""

    input: str          # the placeholder's name
    update: str         # the op that computed the new value (e.g. aten.index_copy.default)
    inplace: bool       # True: the scatter writes into the input; False: new value + copy_ back
    reason: str = ""    # why not in place

    def __str__(self) -> str:
        how = "written in place" if self.inplace else f"computed, then copied back in torch ({self.reason})"
        return f"{self.input}: {self.update.replace('aten.', '')} {how}"


def write_back_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The mutated placeholder when `node` is a kept input mutation `aten.copy_(input, new)`, else None."""
    if node.op == "call_function" and node.target is WRITE_BACK and isinstance(node.args[0], torch.fx.Node) \
            and node.args[0].op == "placeholder":
        return node.args[0]
    return None


def _aliases(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and every view of it (transitively)."""
    out, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_function" and user.target in _VIEWS and user.args and user.args[0] in out \
                    and user not in out:
                out.add(user)
                todo.append(user)
    return out


def _same_layout(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and a.dtype == b.dtype and a.device == b.device and \
        all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape, strict=True) if n > 1)


def _template_only(node: torch.fx.Node) -> bool:
    """A view of the input whose data nobody reads: every use is the destination (shape and dtype
    template) of a functional `aten.copy(dst, src)`, which overwrites all of it (slice assignment
    `x[:, 2:4] = v` is slice_scatter(x, copy(slice(x), v))), or another such view."""
    if node.op != "call_function" or node.target not in _VIEWS or not node.users:
        return False
    for user in node.users:
        if user.op == "call_function" and user.target is aten.copy.default and user.args[0] is node \
                and all(a is not node for a in user.args[1:]):
            continue
        if not _template_only(user):
            return False
    return True


SCATTERS = (aten.index_copy.default, aten.index_put.default, aten.slice_scatter.default)


def why_not_inplace(copy_node: torch.fx.Node) -> str | None:
    """None when the write-back `copy_(inp, new)` can become an in-place scatter, else why not."""
    inp, new = copy_node.args[0], copy_node.args[1]
    assert isinstance(inp, torch.fx.Node)
    if not isinstance(new, torch.fx.Node) or new.op != "call_function" or new.target not in SCATTERS:
        return "the new value is not a scatter (index_copy, index_put, slice_scatter)"
    if new.args[0] is not inp:
        return "the scatter does not write into the input's old value"
    if new.target is aten.index_put.default and ((len(new.args) > 3 and new.args[3]) or new.kwargs.get("accumulate")):
        return "an accumulating index_put (not safe to run twice)"
    others = [u for u in inp.users if u is not new and u is not copy_node and not _template_only(u)]
    if others:
        return f"the input is also read by {', '.join(sorted(u.name for u in others))}"
    operands: list[torch.fx.Node] = []
    torch.fx.node.map_arg((new.args[1:], new.kwargs), operands.append)
    if any(a is inp for a in operands):
        return "the scatter's values or indices are the input itself"
    if not _same_layout(inp.meta.get("val"), new.meta.get("val")):
        return "the new value's shape, dtype or strides differ from the input's"
    output = next(n for n in reversed(copy_node.graph.nodes) if n.op == "output")
    if _aliases(new) & set(output.all_input_nodes):
        return "the new value is a graph output (it must not alias the input)"
    if new.target is aten.slice_scatter.default and not all(isinstance(a, int | None) for a in new.args[2:]):
        return "a slice_scatter with symbolic bounds"
    return None


def reinplace_input_mutations(gm: torch.fx.GraphModule) -> list[Mutation]:
    """Turn eligible kept input mutations into in-place scatters (module docstring); returns what
    became of every mutated input. Changes `gm` in place (recompiled when anything changed)."""
    mutations: list[Mutation] = []
    graph = gm.graph
    for copy_node in list(graph.nodes):
        inp = write_back_input(copy_node)
        if inp is None:
            continue
        new = copy_node.args[1]
        update = str(new.target) if isinstance(new, torch.fx.Node) and new.op == "call_function" else "a value"
        reason = why_not_inplace(copy_node)
        if reason is not None:
            mutations.append(Mutation(inp.name, update, False, reason))
            continue
        assert isinstance(new, torch.fx.Node)
        with graph.inserting_before(new):
            inplace = _inplace_node(gm, new, inp)
        inplace.meta.update(new.meta)
        inplace.meta["val"] = inp.meta.get("val")
        graph.erase_node(copy_node)
        new.replace_all_uses_with(inplace)
        graph.erase_node(new)
        mutations.append(Mutation(inp.name, update, True))
    if any(m.inplace for m in mutations):
        gm.recompile()
    return mutations


def _inplace_node(gm: torch.fx.GraphModule, new: torch.fx.Node, inp: torch.fx.Node) -> torch.fx.Node:
    graph = gm.graph
    if new.target is aten.index_copy.default:
        return graph.call_function(aten.index_copy_.default, (inp, *new.args[1:]), dict(new.kwargs))
    if new.target is aten.index_put.default:
        return graph.call_function(aten.index_put_.default, (inp, new.args[1], new.args[2], False))
    # slice_scatter(inp, src, dim, start, end, step) == index_put_(inp, [None] * dim + [arange], src)
    val = inp.meta["val"]
    names = ("input", "src", "dim", "start", "end", "step")[:len(new.args)]
    params: dict[str, Any] = {"dim": 0, "start": None, "end": None, "step": 1,
                              **dict(zip(names, new.args, strict=True)), **new.kwargs}
    dim = int(params["dim"]) % max(val.dim(), 1)
    start, end, step = params["start"], params["end"], int(params["step"])
    positions = list(range(int(val.shape[dim]))[slice(start, end, step)])
    name = f"_fg_slice_index_{inp.name}"
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        index = torch.tensor(positions, dtype=torch.int64, device=val.device)
    gm.register_buffer(name, index, persistent=False)
    index_node = graph.get_attr(name)
    fake_mode = getattr(val, "fake_mode", None)
    if fake_mode is not None:   # a fake value of static shape (from_tensor could give it a symbolic size)
        with fake_mode:
            index_node.meta["val"] = torch.empty(len(positions), dtype=torch.int64, device=val.device)
    else:
        index_node.meta["val"] = index
    indices: list[Any] = [None] * dim + [index_node]
    return graph.call_function(aten.index_put_.default, (inp, indices, new.args[1], False))


def order_write_backs(gm: torch.fx.GraphModule) -> int:
    """Move every remaining write-back copy_(input, new) to just before the output (after the
    partitioner has placed its submodules: none may read the input's old value after the copy).
    Returns how many there are."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    moved = 0
    for node in list(gm.graph.nodes):
        if write_back_input(node) is not None and not node.users:
            output.prepend(node)
            moved += 1
    if moved:
        gm.recompile()
    return moved


def mutated_placeholders(sub: torch.fx.GraphModule) -> set[str]:
    """Names of a partition's placeholders written in place by its in-place scatters."""
    return {str(n.args[0].name) for n in sub.graph.nodes
            if n.op == "call_function" and n.target in INPLACE_ATEN and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op == "placeholder"}


# ---------------- the IR ops: scatters that write into their destination (a Plan input) ----------------

def _inplace_index_copy_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    from ..ops.scatter import _index_copy_infer

    _index_copy_infer(specs, a)   # the functional op's checks
    return specs[0]               # the destination itself: its shape, dtype and strides


def _inplace_index_put_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    from ..ops.scatter import _index_put_infer

    if a.get("accumulate", False):
        raise ShapeError("index_put_inplace overwrites (accumulate=False): an accumulation is not safe to repeat")
    _index_put_infer(specs, a)
    return specs[0]


def _inplace_index_copy_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    from ..ops.scatter import INPLACE_FORMS  # the in-place forms the memory plan also runs

    return INPLACE_FORMS["index_copy"](xs, a)


def _inplace_index_put_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    from ..ops.scatter import INPLACE_FORMS

    return INPLACE_FORMS["index_put"](xs, a)   # accumulate=False: the shape rule refuses an accumulation


def _index_put_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    """Indices and values read once, the indexed region written once (no copy of the destination)."""
    from ..ops import _rules as R
    from ..ops.scatter import indexed_shape

    x, values, *indices = ins
    region = indexed_shape(x.shape, tuple(a["index_dims"]), R.broadcast_shapes(*(i.shape for i in indices)))
    numel = 1
    for s in region:
        numel *= s
    return Cost(sum(i.nbytes for i in indices) + values.nbytes + numel * x.itemsize, 0)


# RANDOM: not pure (never CSE'd or constant-folded); NO_UPCAST: the destination in its own dtype;
# WRITES_INPUT: the output is the first input's memory (the memory plan gives it no buffer)
define("index_copy_inplace", _inplace_index_copy_infer, _inplace_index_copy_ref, num_inputs=(3, 3),
       props={NO_UPCAST, RANDOM, WRITES_INPUT},
       cost_fn=lambda i, o, a: Cost(i[1].nbytes + 2 * i[2].nbytes, 0),
       doc="x.index_copy_(dim, index, source) on a graph input x (a module buffer such as a KV cache): "
           "writes only the indexed slices into x's memory and returns x. Made by the torch frontend "
           "for a kept input mutation (frontends/input_mutation.py); not for graphs built by hand.")
define("index_put_inplace", _inplace_index_put_infer, _inplace_index_put_ref, num_inputs=(3, -1),
       props={NO_UPCAST, RANDOM, WRITES_INPUT},
       cost_fn=_index_put_cost,
       doc="x.index_put_(indices, values) (accumulate=False) on a graph input x: writes only the indexed "
           "region into x's memory and returns x; inputs (x, values, *index tensors), attrs index_dims. "
           "Made by the torch frontend for a kept input mutation (frontends/input_mutation.py).")
