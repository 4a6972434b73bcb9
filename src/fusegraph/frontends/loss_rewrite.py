"""Cross-entropy in training without saving an fp32 log-softmax of [tokens, vocab]: a joint-graph rewrite.

F.cross_entropy(logits.float(), target) traces to `xf = _to_copy(logits, fp32)`, `out = _log_softmax(xf,
dim)`, `nll_loss_forward(out, target)`, and in the backward `nll_loss_backward(g, out, target)` followed
by the log-softmax gradient `g_nll - exp(out) * sum(g_nll, dim, keepdim)` (decomposed by AOTAutograd, or
the whole `_log_softmax_backward_data(g, out, dim, dtype)`). The default partitioner saves `out` for the
backward: for GPT-2 an fp32 [8192, 50257] tensor (1.6 GB) written by the forward and read back.

`rewrite_log_softmax_for_backward(gm)`, on the joint graph before it is partitioned, for every
`_log_softmax` whose output the backward reads:
  - the forward computes lse = amax + log(sum(exp(xf - amax))) ([rows, 1], the log-softmax dtype) and
    nll_loss_forward reads only the picked log-probabilities: x[row, target] gathered from the logits in
    their own dtype (before the upcast), minus lse, as an [N, 2] tensor (both columns alike) with targets
    0 or 1 (ignore_index kept), so loss and total_weight come from nll_loss_forward unchanged; other
    forward readers get out = xf - lse;
  - the backward recomputes xf from the value before the upcast (the bf16 logits, with the same views and
    casts), so the partitioner saves those logits and lse instead of out: exp(out) becomes
    exp(xf - lse), nll_loss_backward takes xf for its shape, and _log_softmax_backward_data becomes
    g - exp(xf - lse) * sum(g, dim, keepdim) (cast to its input dtype).
`sum(nll_loss_backward(...), class dim)` (the row sums of the one-hot gradient) becomes the row weight
-grad[/total_weight] on rows whose target is not ignored, computed without reading [N, C]; the logits'
gradient is then one pointwise pass: bf16 logits + lse + target in, bf16 gradient out.
Anything else (no backward reader, a reader we do not know, class weights, dynamic shapes) is left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..settings import settings

aten = torch.ops.aten
prims = torch.ops.prims

# Ops between the pre-upcast logits and the log-softmax input that the backward may replay for free.
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                      aten.alias.default, aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
                      aten.squeeze.dims, aten.squeeze.default})
CAST_OPS = frozenset({aten._to_copy.default, prims.convert_element_type.default})
ALIAS_OPS = frozenset({aten.detach.default, aten.alias.default})
FORWARD, BACKWARD = "is_forward", "is_backward"


def rewrite_log_softmax_for_backward(gm: fx.GraphModule) -> int:
    """Rewrite a joint graph's log-softmaxes as the module doc says; how many rewrites (log-softmaxes + row sums)."""
    graph = gm.graph
    backward = backward_nodes(graph)
    if backward is None or detect_fake_mode(_vals(graph)) is None:
        return 0
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._log_softmax.default and node not in backward:
            why_not = _rewrite_one(graph, node, backward)
            if why_not is None:
                count += 1
            elif settings.debug >= 1 and why_not:
                print(f"[fusegraph] loss rewrite: {node.name} keeps its saved log-softmax: {why_not}", file=sys.stderr)
    count += _rewrite_nll_backward_row_sums(graph)
    if count:
        graph.eliminate_dead_code()
        gm.recompile()
    return count


# ---------------- the log-softmax ----------------

def _rewrite_one(graph: fx.Graph, lsm: fx.Node, backward: set[fx.Node]) -> str | None:
    """None when rewritten; else why not ('' when there is simply no backward reader)."""
    out_val = lsm.meta.get("val")
    if not isinstance(out_val, torch.Tensor) or not _static(out_val):
        return "no static shape"
    xf, dim = lsm.args[0], int(lsm.args[1]) % out_val.dim()  # type: ignore[arg-type]
    if not isinstance(xf, fx.Node):
        return "input is not a node"
    readers = list(dict.fromkeys(_readers(lsm)))
    bw_readers = [r for r in readers if r in backward]
    if not bw_readers:
        return ""
    for reader in bw_readers:
        if not _known_backward_reader(reader, dim):
            return f"the backward reads it in {reader.name} ({reader.target})"
    base, chain = _pre_upcast(xf)

    # forward: lse, the nll_loss_forward inputs, out = xf - lse for anyone else
    with graph.inserting_before(lsm.next):
        xc = _cast(graph, xf, out_val.dtype, lsm)
        peak = _emit(graph, aten.amax.default, (xc, [dim], True), lsm)
        summed = _emit(graph, aten.sum.dim_IntList, (_emit(graph, aten.exp.default, (
            _emit(graph, aten.sub.Tensor, (xc, peak), lsm),), lsm), [dim], True), lsm)
        lse = _emit(graph, aten.add.Tensor, (_emit(graph, aten.log.default, (summed,), lsm), peak), lsm)
        out_fw: fx.Node | None = None
    for reader in [r for r in readers if r not in backward]:
        if _is_simple_nll_forward(reader, dim):
            with graph.inserting_before(reader):
                reader.update_arg(0, _picked_log_probs(graph, reader, base, chain, lse, out_val.dtype))
                reader.update_arg(1, _picked_targets(graph, reader))
            continue
        if out_fw is None:
            with graph.inserting_before(lse.next):
                out_fw = _emit(graph, aten.sub.Tensor, (xc, lse), lsm)
        _replace_reads(reader, lsm, out_fw)

    # backward: xf recomputed from the saved pre-upcast value
    first = min(bw_readers, key=_position(graph))
    with graph.inserting_before(first):
        xb = base
        for step in chain:
            xb = _emit(graph, step.target, (xb, *step.args[1:]), first, dict(step.kwargs))
        xb = _cast(graph, xb, out_val.dtype, first)
        shifted = _emit(graph, aten.sub.Tensor, (xb, lse), first)
    for reader in bw_readers:
        if reader.target is aten.exp.default:
            reader.update_arg(0, shifted)
        elif reader.target is aten.nll_loss_backward.default:
            reader.update_arg(1, xb)                      # read for its shape and dtype only
        else:                                             # _log_softmax_backward_data(g, out, dim, dtype)
            _replace_log_softmax_backward(graph, reader, shifted, dim)
    return None


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`, looking through detach/alias."""
    found: list[fx.Node] = []
    for user in node.users:
        if user.op == "call_function" and user.target in ALIAS_OPS:
            found.extend(_readers(user))
        else:
            found.append(user)
    return found


def _alias_root(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in ALIAS_OPS:
        node = node.args[0]
    return node


def _replace_reads(reader: fx.Node, lsm: fx.Node, new: fx.Node) -> None:
    for arg in list(reader.all_input_nodes):
        if _alias_root(arg) is lsm:
            reader.replace_input_with(arg, new)


def _known_backward_reader(reader: fx.Node, dim: int) -> bool:
    if reader.op != "call_function":
        return False
    if reader.target is aten.exp.default:
        return True
    if reader.target is aten.nll_loss_backward.default:
        return _alias_root(reader.args[1]) is not _alias_root(reader.args[0])   # out is `self`, not grad
    if reader.target is aten._log_softmax_backward_data.default:
        g, out, d = reader.args[:3]
        return not _is_alias_of(g, out) and int(d) % len(reader.meta["val"].shape) == dim  # type: ignore[arg-type]
    return False


def _is_alias_of(a: Any, b: Any) -> bool:
    return _alias_root(a) is _alias_root(b)


def _is_simple_nll_forward(reader: fx.Node, dim: int) -> bool:
    """nll_loss_forward(out [N, C], target [N], weight None, reduction, ignore_index), classes on dim 1."""
    if reader.op != "call_function" or reader.target is not aten.nll_loss_forward.default:
        return False
    if len(reader.args) != 5 or reader.kwargs:
        return False
    lp, target, weight = reader.args[:3]
    lp_val = lp.meta.get("val") if isinstance(lp, fx.Node) else None
    t_val = target.meta.get("val") if isinstance(target, fx.Node) else None
    return weight is None and dim == 1 and isinstance(lp_val, torch.Tensor) and lp_val.dim() == 2 and \
        isinstance(t_val, torch.Tensor) and t_val.dim() == 1


def _pre_upcast(xf: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(base, chain): `xf` is base run through `chain` (views and widening float casts, in order)."""
    chain: list[fx.Node] = []
    node = xf
    while node.op == "call_function" and (node.target in VIEW_OPS or _is_widening_cast(node)) and \
            node.all_input_nodes == [node.args[0]]:
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    return node, chain[::-1]


def _is_widening_cast(node: fx.Node) -> bool:
    if node.target not in CAST_OPS or not isinstance(node.args[0], fx.Node):
        return False
    if set(node.kwargs) - {"dtype", "layout", "device", "memory_format"}:
        return False
    src, dst = node.args[0].meta.get("val"), node.meta.get("val")
    return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.is_floating_point() and \
        dst.is_floating_point() and src.device == dst.device and src.element_size() < dst.element_size()


def _picked_log_probs(graph: fx.Graph, nll: fx.Node, base: fx.Node, chain: list[fx.Node], lse: fx.Node,
                      dtype: torch.dtype) -> fx.Node:
    """x[row, target] - lse, gathered from the logits in their own dtype, as [N, 2] (columns alike)."""
    low = base
    for step in chain:
        if step.target not in CAST_OPS:                 # casts commute with views and gathers: cast after
            low = _emit(graph, step.target, (low, *step.args[1:]), nll, dict(step.kwargs))
    target = nll.args[1]
    valid = _emit(graph, aten.ne.Scalar, (target, nll.args[4]), nll)
    safe = _emit(graph, aten.where.ScalarOther, (valid, target, 0), nll)
    picked = _emit(graph, aten.gather.default, (low, 1, _emit(graph, aten.unsqueeze.default, (safe, 1), nll)), nll)
    log_prob = _emit(graph, aten.sub.Tensor, (_cast(graph, picked, dtype, nll), lse), nll)
    rows = int(lse.meta["val"].shape[0])
    return _emit(graph, aten.expand.default, (log_prob, [rows, 2]), nll)


def _picked_targets(graph: fx.Graph, nll: fx.Node) -> fx.Node:
    """Target 0 or 1 (whichever is not ignore_index) where the row counts, ignore_index where it does not."""
    ignore = int(nll.args[4])  # type: ignore[arg-type]
    column = 1 if ignore == 0 else 0
    valid = _emit(graph, aten.ne.Scalar, (nll.args[1], ignore), nll)
    return _emit(graph, aten.where.ScalarSelf, (valid, column, nll.args[1]), nll)   # target == ignore_index there


def _replace_log_softmax_backward(graph: fx.Graph, node: fx.Node, shifted: fx.Node, dim: int) -> None:
    grad, input_dtype = node.args[0], node.args[3]
    with graph.inserting_before(node):
        probs = _emit(graph, aten.exp.default, (shifted,), node)
        row_sum = _emit(graph, aten.sum.dim_IntList, (grad, [dim], True), node)
        result = _emit(graph, aten.sub.Tensor, (grad, _emit(graph, aten.mul.Tensor, (probs, row_sum), node)), node)
        result = _cast(graph, result, input_dtype, node)  # type: ignore[arg-type]
    node.replace_all_uses_with(result)
    graph.erase_node(node)


# ---------------- the row sums of nll_loss_backward ----------------

def _rewrite_nll_backward_row_sums(graph: fx.Graph) -> int:
    """sum(nll_loss_backward(grad, self [N, C], target, None, reduction, ii, total), [1]) -> the row weight."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
            continue
        nll, dims = node.args[0], node.args[1]
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if not isinstance(nll, fx.Node) or nll.target is not aten.nll_loss_backward.default or \
                node.kwargs.get("dtype") is not None or not isinstance(dims, list | tuple) or len(dims) != 1:
            continue
        grad, lp, target, weight, reduction, ignore, total = nll.args[:7]
        lp_val = lp.meta.get("val")  # type: ignore[union-attr]
        if weight is not None or not isinstance(lp_val, torch.Tensor) or lp_val.dim() != 2 or \
                int(dims[0]) % 2 != 1 or reduction not in (0, 1, 2):
            continue
        with graph.inserting_before(node):
            scale = _emit(graph, aten.div.Tensor, (grad, total), node) if reduction == 1 else grad
            valid = _emit(graph, aten.ne.Scalar, (target, ignore), node)
            weight_row = _emit(graph, aten.where.ScalarOther, (valid, _emit(graph, aten.neg.default, (scale,), node),
                                                               0.0), node)
            if keepdim:
                weight_row = _emit(graph, aten.unsqueeze.default, (weight_row, 1), node)
            weight_row = _cast(graph, weight_row, node.meta["val"].dtype, node)
        if tuple(weight_row.meta["val"].shape) != tuple(node.meta["val"].shape):
            continue            # (left for DCE) e.g. a 0-dim grad with reduction none
        node.replace_all_uses_with(weight_row)
        count += 1
    return count


# ---------------- building nodes ----------------

def backward_nodes(graph: fx.Graph) -> set[fx.Node] | None:
    """The nodes default_partition puts in the backward: those after the last forward-tagged node or
    primal input. None when the graph carries no partitioner tags (then nothing is rewritten)."""
    nodes = list(graph.nodes)
    if not any(n.meta.get("partitioner_tag") in (FORWARD, BACKWARD) for n in nodes):
        return None
    last = max((i for i, n in enumerate(nodes) if n.meta.get("partitioner_tag") == FORWARD or
                (n.op == "placeholder" and str(n.target).startswith("primals"))), default=-1)
    return {n for n in nodes[last + 1:] if n.op != "output"}


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _vals(graph: fx.Graph) -> list[Any]:
    return [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _static(val: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in val.shape)


def _cast(graph: fx.Graph, node: fx.Node, dtype: Any, like: fx.Node) -> fx.Node:
    if dtype is None or node.meta["val"].dtype == dtype:
        return node
    return _emit(graph, prims.convert_element_type.default, (node, dtype), like)


def _emit(graph: fx.Graph, target: Any, args: Sequence[Any], like: fx.Node,
          kwargs: dict[str, Any] | None = None) -> fx.Node:
    """A call_function node with `like`'s meta (partitioner tag, source line) and its own fake value."""
    kwargs = dict(kwargs or {})
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", "original_aten")}
    fake_args, fake_kwargs = fx.node.map_arg((tuple(args), kwargs), lambda n: n.meta["val"])
    fake_mode = detect_fake_mode([v for v in _flat(fake_args) if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise AssertionError(f"loss rewrite: no fake value among the inputs of {node.name}")
    with fake_mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list | tuple):
        return [v for item in values for v in _flat(item)]
    return [values]

