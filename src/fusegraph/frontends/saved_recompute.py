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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .loss_rewrite import BACKWARD, backward_nodes

aten = torch.ops.aten
prims = torch.ops.prims

MAX_CHAIN = 16   # ops in one recipe
PASS_THROUGH = frozenset({aten.detach.default, aten.alias.default, prims.convert_element_type.default,
                          aten._to_copy.default})


def recompute_saved_pointwise(gm: fx.GraphModule) -> int:
    """Rewrite the joint graph as the module doc says; returns how many saved values were dropped."""
    graph = gm.graph
    nodes = list(graph.nodes)
    backward = backward_nodes(graph)
    if not backward:
        return 0
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
    position = {n: i for i, n in enumerate(nodes)}
    for value, recipe in recipes.items():
        users = sorted((u for u in value.users if u in backward), key=position.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(users[0]):
            for op in recipe:                       # producers first
                copy = graph.node_copy(op, lambda n: copies.get(n, n))
                copy.meta = dict(op.meta)
                copy.meta["partitioner_tag"] = BACKWARD
                copies[op] = copy
        for user in users:
            user.replace_input_with(value, copies[value])
    if recipes:
        graph.lint()
        gm.recompile()
    return len(recipes)


def _recipe(value: fx.Node, saved: set[fx.Node], through_saved: bool = False) -> list[fx.Node] | None:
    """The ops computing `value` from saved values or inputs, producers first; None when there is none
    within MAX_CHAIN cheap ops whose tensor leaves are no larger than `value`. `through_saved`: walk
    through saved cheap values and views too, down to the non-pointwise producers (or inputs) they
    come from; those leaves may not be saved yet (the caller weighs them)."""
    if not _cheap(value):
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
        if not (_cheap(node) or (through_saved and _view(node))) or len(chain) >= MAX_CHAIN:
            return False
        if not all(visit(arg) for arg in node.all_input_nodes):
            return False
        chain.append(node)
        return True

    if not visit(value) or not leaves:
        return None
    if sum(_nbytes(leaf) for leaf in leaves) > _nbytes(value):
        return None
    return chain


def _leaves(recipe: list[fx.Node]) -> set[fx.Node]:
    inside = set(recipe)
    return {arg for op in recipe for arg in op.all_input_nodes if arg not in inside}


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
