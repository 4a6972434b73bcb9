"""Save fewer activations: pointwise values the backward reads are recomputed there from a value it
saves anyway.

AOTAutograd's default partitioner saves every forward value a backward node reads. For GPT-2's tanh
GELU that is the pre-activation x plus three pointwise functions of it (0.5 * x, tanh(...), 1 +
tanh(...)): the backward's GELU-gradient kernel then reads five [tokens, 4 * d] tensors and writes
one (12 bytes per element in bf16), where reading the gradient and x is enough (6 bytes; Inductor's
kernel ran 0.045 ms against our 0.12 ms per layer on the H200), and the forward stores three tensors
it need not.

`recompute_saved_pointwise(joint)` runs on the joint graph before the partitioner (partition_fn). For
each forward value v a backward node reads, it looks for a recipe: v's producers back through
pointwise ops (torch.Tag.pointwise, dtype conversions, detach/alias; nothing random, at most
MAX_CHAIN ops) down to leaves that are saved anyway (a forward value the backward reads directly,
that is not itself recomputed) or are graph inputs, with the leaves' tensors no larger in total than
v, and only when every backward reader of v is pointwise too (a GEMM would need the recomputed value
materialized again: GPT-2's GELU output, read by the down projection's weight gradient, stays saved).
A second kind of recipe walks through saved pointwise values and views down to the non-pointwise
producers they come from (a GEMM's output, an input): those leaves are saved instead, taken for
all such recipes at once when the bytes they drop exceed the leaves' bytes. Under CUDA autocast the
GELU runs pow in fp32, so the saved set is x in fp32, tanh(...) and 1 + tanh(...) in fp32 and
0.5 * x in bf16, none of them the up projection's bf16 output itself; that output is then the one
value saved (2 bytes an element instead of 14).
The backward's uses of v then read a copy of the recipe placed in the backward, so v is no longer
saved; the partitioner saves the leaves. Saved bytes only shrink, and our fusion
folds the recipe into the kernel that reads it. Setting recompute_saved (FUSEGRAPH_RECOMPUTE_SAVED=0)
turns it off; the min-cut partitioner (setting recompute) does this and more, by its own rules.

Values a non-pointwise backward op reads are recomputed too, into a tensor of their own, to a memory
budget (`_materialized`, setting recompute_materialized). A captured training step keeps its gradients
and its copy of the input batch allocated from step to step, which eager does not hold at its peak (the
start of its backward), so on ResNet-50 at batch 64 the step's peak was 3699 MiB against eager's 3587
(bench/memory_train_gpu.py). Each ReLU(batchnorm(conv)) that the next convolution's weight gradient reads
is rebuilt in the backward from the convolution output and the batch mean and 1/std the forward saves
(`_emit_batchnorm`: no statistics are redone), largest first, until the bytes dropped cover that excess
('held', convolution inputs only; GEMM operands with 'all').
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..errors import InvalidValueError
from ..settings import settings
from .loss_rewrite import BACKWARD, backward_nodes

aten = torch.ops.aten
prims = torch.ops.prims

MAX_CHAIN = 16   # ops in one recipe
PASS_THROUGH = frozenset({aten.detach.default, aten.alias.default, prims.convert_element_type.default,
                          aten._to_copy.default})


@dataclass(frozen=True)
class Recomputed:
    """What recompute_saved_pointwise dropped from the saved activations."""

    pointwise: int = 0          # values read by pointwise backward ops only
    materialized: int = 0       # values a convolution or GEMM reads, recomputed into a tensor of their own
    dropped_bytes: int = 0      # their bytes (saved ones no longer saved)
    budget_bytes: float = 0.0   # recompute_materialized='held': what the captured step holds beyond eager

    def __str__(self) -> str:
        budget = f" (budget {self.budget_bytes / 2**20:.1f} MiB)" if 0 < self.budget_bytes < float("inf") else ""
        return (f"saved activations recomputed in the backward: {self.pointwise} pointwise, {self.materialized} "
                f"materialized{budget}; {self.dropped_bytes / 2**20:.1f} MiB no longer saved")


def recompute_saved_pointwise(gm: fx.GraphModule, num_fwd_outputs: int | None = None) -> Recomputed:
    """Rewrite the joint graph as the module doc says; returns what it dropped."""
    graph = gm.graph
    nodes = list(graph.nodes)
    backward = backward_nodes(graph)
    if not backward:
        return Recomputed()
    forward = [n for n in nodes if n not in backward and n.op != "output"]
    read_by_backward = {n for n in forward if any(u in backward for u in n.users)}
    recipes: dict[fx.Node, list[fx.Node]] = {}
    rooted: dict[fx.Node, list[fx.Node]] = {}
    for value in read_by_backward:
        if not all(_cheap(u) for u in value.users if u in backward):
            continue    # a GEMM (or any non-pointwise op) would need the recomputed value materialized
        recipe = _recipe(value, read_by_backward, through_saved=True)
        if recipe is not None:
            rooted[value] = recipe
        recipe = _recipe(value, read_by_backward)
        if recipe is not None:
            recipes[value] = recipe
    # Recipes rooted at producers (a GEMM's output, through views), which then become saved instead:
    # taken together when the values they drop outweigh the new leaves, e.g. GPT-2's GELU under CUDA
    # autocast saves x in fp32, tanh(.) and 1 + tanh(.) in fp32 and 0.5 * x in bf16 (14 bytes an
    # element) where the up projection's bf16 output (2 bytes) computes them all.
    new_leaves = {leaf for r in rooted.values() for leaf in _leaves(r)} - read_by_backward
    if rooted and sum(map(_nbytes, rooted)) > sum(map(_nbytes, new_leaves)):
        recipes.update(rooted)
    # a leaf must stay saved: drop recipes whose leaves are themselves being recomputed
    changed = True
    while changed:
        changed = False
        for value in list(recipes):
            if any(leaf in recipes for leaf in _leaves(recipes[value])):
                del recipes[value]
                changed = True
    materialized, budget = _materialized(gm, backward, read_by_backward, recipes, num_fwd_outputs)
    position = {n: i for i, n in enumerate(nodes)}
    # a recomputed tensor goes before its first backward reader, or the first reader of a pointwise
    # recipe that reads it (a detach of a ReLU output, for the ReLU's gradient)
    first: dict[fx.Node, list[fx.Node]] = {v: [u for u in v.users if u in backward] for v in materialized}
    for value, recipe in recipes.items():
        for leaf in _leaves(recipe) & materialized.keys():
            first[leaf] += [u for u in value.users if u in backward]
    done: dict[fx.Node, fx.Node] = {}
    for value, recipe in [*materialized.items(), *recipes.items()]:
        users = sorted((u for u in value.users if u in backward), key=position.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(min(first.get(value, users), key=position.__getitem__)):
            for op in recipe:                       # producers first
                if _batchnorm_output(op) is not None:
                    copies[op] = _emit_batchnorm(graph, op, copies)
                    continue
                copy = graph.node_copy(op, lambda n: copies.get(n, done.get(n, n)))
                copy.meta = dict(op.meta)
                copy.meta["partitioner_tag"] = BACKWARD
                copies[op] = copy
        done[value] = copies[value]
        for user in users:
            user.replace_input_with(value, copies[value])
    if recipes or materialized:
        graph.lint()
        gm.recompile()
    return Recomputed(len(recipes), len(materialized), sum(map(_nbytes, [*recipes, *materialized])),
                      budget if materialized else 0.0)


def _materialized(gm: fx.GraphModule, backward: set[fx.Node], saved: set[fx.Node],
                  taken: dict[fx.Node, list[fx.Node]], num_fwd_outputs: int | None
                  ) -> tuple[dict[fx.Node, list[fx.Node]], float]:
    """Saved values that a non-pointwise backward op reads (a convolution's input for its weight
    gradient: ReLU(batchnorm(conv)) in ResNet) and that are pointwise functions of values saved anyway:
    recomputed in the backward into a fresh tensor there, largest first, as setting
    recompute_materialized says: 'held' convolution inputs until the bytes dropped cover what a
    captured training step holds beyond eager (the gradients, which stay in the backward's graph
    memory, and the forward's inputs that are not parameters, which it copies into its own); 'all'
    every one (GEMM operands too: less memory, more time); 'off' none. Returns them and the budget."""
    mode = settings.recompute_materialized
    if mode == "off":
        return {}, 0.0
    if mode not in ("held", "all"):
        raise InvalidValueError(f"setting recompute_materialized={mode!r}: use 'held', 'all' or 'off'")
    candidates = []
    for value in saved - set(taken):
        if all(_cheap(u) for u in value.users if u in backward):
            continue    # pointwise readers only: the rules above decided it
        if value.meta["val"].dim() < 2:
            continue    # a counter or per-channel statistics: a launch for no memory
        if mode == "held" and not any(u.target is aten.convolution_backward.default for u in value.users):
            continue    # a GEMM operand: GPT-2's step ran 2.2% slower with its GELU outputs recomputed
        recipe = _recipe(value, saved, materialize=True)
        if recipe is not None:
            candidates.append((value, recipe))
    budget = _held_bytes(gm, backward, num_fwd_outputs) if mode == "held" else float("inf")
    if not candidates:
        return {}, budget
    chosen: dict[fx.Node, list[fx.Node]] = {}
    blocked: set[fx.Node] = set()   # leaves of chosen recipes: they stay saved
    left = budget
    for value, recipe in sorted(candidates, key=lambda c: -_nbytes(c[0])):
        if left <= 0:
            break
        leaves = _leaves(recipe)
        if value in blocked or leaves & (set(chosen) | set(taken)):
            continue    # a recipe reads saved values only (a pointwise recipe may read this one's copy)
        chosen[value] = recipe
        blocked |= leaves
        left -= _nbytes(value)
    return chosen, budget


def _held_bytes(gm: fx.GraphModule, backward: set[fx.Node], num_fwd_outputs: int | None) -> int:
    """Bytes a captured training step keeps allocated that eager's step has not at its peak (the
    start of the backward): every gradient (the backward's outputs, in its graph's memory from one
    step to the next) and every primal input without a gradient (the batch, which the captured
    forward copies into its own buffer). The joint graph returns the forward's outputs, then one
    gradient (or None) per primal input, in order."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    primals = [p for p in gm.graph.nodes if p.op == "placeholder" and str(p.target).startswith("primals")]
    if num_fwd_outputs is None or len(outs) - num_fwd_outputs != len(primals):   # the gradients alone
        return sum(_nbytes(a) for a in outs if isinstance(a, fx.Node) and a in backward)
    grads = outs[num_fwd_outputs:]
    return sum(_nbytes(g) if isinstance(g, fx.Node) else _nbytes(p) for g, p in zip(grads, primals, strict=True))


def _recipe(value: fx.Node, saved: set[fx.Node], through_saved: bool = False,
            materialize: bool = False) -> list[fx.Node] | None:
    """The ops computing `value` from saved values or inputs, producers first; None when there is none
    within MAX_CHAIN cheap ops whose tensor leaves are no larger than `value`. `through_saved`: walk
    through saved cheap values and views too, down to the non-pointwise producers (or inputs) they
    come from; those leaves may not be saved yet (the caller weighs them). `materialize` (the value
    is recomputed into a tensor of its own): a training batchnorm's output counts as pointwise too,
    from its input and the mean and 1/std it saves, and the leaves may be up to twice the value's
    bytes (they are saved anyway: this bounds the reads the recompute costs, not the memory)."""
    if not (_cheap(value) or (materialize and _batchnorm_output(value, saved) is not None)):
        return None
    chain: list[fx.Node] = []
    leaves: set[fx.Node] = set()
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in seen:
            return True
        seen.add(node)
        if node is not value and node.op in ("placeholder", "get_attr"):
            leaves.add(node)
            return True
        if through_saved:
            if node is not value and not (_cheap(node) or _view(node)):
                leaves.add(node)      # a GEMM's (or any producer's) output: recomputed from
                return True
        elif node is not value and node in saved:
            leaves.add(node)
            return True
        norm = _batchnorm_output(node, saved) if materialize else None
        if not (_cheap(node) or norm is not None or (through_saved and _view(node))) or len(chain) >= MAX_CHAIN:
            return False
        if not all(visit(arg) for arg in (norm if norm is not None else node.all_input_nodes)):
            return False
        chain.append(node)
        return True

    if not visit(value) or not leaves:
        return None
    if sum(_nbytes(leaf) for leaf in leaves) > _nbytes(value) * (2 if materialize else 1):
        return None
    return chain


def _leaves(recipe: list[fx.Node]) -> set[fx.Node]:
    inside = set(recipe)
    return {arg for op in recipe for arg in (_batchnorm_output(op) or op.all_input_nodes) if arg not in inside}


BATCHNORM = aten._native_batch_norm_legit_functional.default


def _batchnorm_output(node: fx.Node, saved: set[fx.Node] | None = None) -> list[fx.Node] | None:
    """For the output (item 0) of a training batchnorm whose mean and 1/std (items 1 and 2) exist as
    nodes (and, given `saved`, are saved for the backward): [input, mean, 1/std, weight, bias] (the
    tensors among them), what it is recomputed from. None for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return None
    norm = node.args[0]
    if not isinstance(norm, fx.Node) or norm.target is not BATCHNORM or not norm.args[5]:
        return None
    stats = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
    if 1 not in stats or 2 not in stats or (saved is not None and not {stats[1], stats[2]} <= saved):
        return None
    x, weight, bias = norm.args[0], norm.args[1], norm.args[2]
    return [n for n in (x, stats[1], stats[2], weight, bias) if isinstance(n, fx.Node)]


def _emit_batchnorm(graph: fx.Graph, node: fx.Node, copies: dict[fx.Node, fx.Node]) -> fx.Node:
    """(x - mean) * rstd * weight + bias in fp32, cast to the output's dtype: the batchnorm output
    `node` rebuilt (at the graph's insertion point, tagged backward) from the mean and 1/std its
    forward saved, so the backward does not redo the statistics."""
    norm = node.args[0]
    assert isinstance(norm, fx.Node)
    stats = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
    x, weight, bias = (copies.get(a, a) if isinstance(a, fx.Node) else a for a in norm.args[:3])
    assert isinstance(x, fx.Node)
    out_val = node.meta["val"]
    fake = out_val.fake_mode if hasattr(out_val, "fake_mode") else contextlib.nullcontext()
    channel = [1, out_val.shape[1]] + [1] * (out_val.dim() - 2)

    def emit(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with fake:
            val = target(*vals, **kwargs)
        made = graph.call_function(target, tuple(args), kwargs)
        made.meta = {"val": val, "partitioner_tag": BACKWARD}
        return made

    def f32(n: fx.Node, per_channel: bool) -> fx.Node:
        if n.meta["val"].dtype != torch.float32:
            n = emit(prims.convert_element_type.default, n, torch.float32)
        return emit(aten.view.default, n, channel) if per_channel else n

    y = emit(aten.mul.Tensor, emit(aten.sub.Tensor, f32(x, False), f32(stats[1], True)), f32(stats[2], True))
    if isinstance(weight, fx.Node):
        y = emit(aten.mul.Tensor, y, f32(weight, True))
    if isinstance(bias, fx.Node):
        y = emit(aten.add.Tensor, y, f32(bias, True))
    return emit(prims.convert_element_type.default, y, out_val.dtype) if out_val.dtype != torch.float32 else y


VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                   aten.squeeze.dim})


def _view(node: fx.Node) -> bool:
    """A reshaping view (free to redo) with a static-shaped tensor value."""
    val = node.meta.get("val")
    return (node.op == "call_function" and node.target in VIEWS and isinstance(val, torch.Tensor)
            and all(isinstance(s, int) for s in val.shape))


def _cheap(node: fx.Node) -> bool:
    """A deterministic pointwise op with a static-shaped tensor value."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target not in PASS_THROUGH and torch.Tag.pointwise not in target.tags:
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


def _nbytes(node: fx.Node) -> int:
    val: Any = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return int(val.numel()) * val.element_size()
