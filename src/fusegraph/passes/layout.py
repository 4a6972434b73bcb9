"""Layout passes for convolution chains: batchnorm folding, and the choice of channels-last.

`fold_batchnorm`: inference batchnorm after a convolution whose weights and batchnorm parameters
are known at build time (constants) becomes part of the convolution: w' = w * s and
b' = (b - mean) * s + beta with s = gamma / sqrt(var + eps), per output channel, computed once
here in fp32 and rounded to the weight dtype. The batchnorm then costs nothing at run time. With
parameters that are graph inputs the batchnorm stays and becomes the convolution kernel's
epilogue (fusion/epilogue.py), which reads the four per-channel vectors once per tile.

`choose_layout` (the `layout` pass, run by build() on the decomposed graph just before fusion):
tensor-core convolutions (fp16/bf16; fp32 when build(allow_tf32=True)) want channels-last (NHWC)
operands; on NCHW tensors cuDNN transposes the activation in and the result out around every
call. The pass finds each region of 4-D values that share one memory layout with such a
convolution (its activation input and output, pointwise ops on them with the same shape, which
covers decomposed batchnorm affines, activations and residual adds) and re-lays the whole region
out as NHWC: a spec change only, since every generated kernel indexes through the specs' strides.
At the region's edge the user's layout is kept: one `to_layout` copy per graph input (none when a
single convolution is its only reader: the convolution call converts it), one per graph output
back to row-major (fused into the last epilogue's store), constant weights re-laid out at build
time. The choice is made when the boundary copies move no more bytes than the transposes NCHW
would cost (build(conv_layout="NHWC"|"NCHW") forces either way); FUSEGRAPH_DEBUG=1 prints it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ..ir.graph import Graph
from ..ir.node import Attrs, Node
from ..ir.registry import POINTWISE, SOURCE, VIEW, get_op
from ..ir.spec import TensorSpec, contiguous_strides
from ..settings import settings
from .base import Pass, graph_pass


def _known(node: Node) -> torch.Tensor | None:
    if node.op == "constant":
        value = node.attrs.get("value")
        return value if isinstance(value, torch.Tensor) else None
    return None


def _constant(value: torch.Tensor, like: Node, name: str) -> Node:
    from ..ir import dtypes

    spec = TensorSpec(tuple(value.shape), dtypes.canonical(value.dtype), device=like.spec.device)
    return Node(op="constant", inputs=(), attrs=Attrs(value=value.contiguous()), specs=(spec,), name=name,
                source=like.source)


def folded_conv(bn: Node, users: dict[int, list[Node]], outputs: frozenset[int]) -> Node | None:
    """The convolution with `bn` folded in, or None when it does not apply."""
    if bn.op != "batchnorm" or bn.multi_output or bn.attrs.get("training", False) \
            or not bn.attrs.get("has_running", False):
        return None
    conv = bn.inputs[0]
    if conv.op != "conv2d" or len(users.get(conv.id, ())) != 1 or conv.id in outputs:
        return None
    names = ["running_mean", "running_var"]
    names += [n for n, flag in (("weight", "has_weight"), ("bias", "has_bias")) if bn.attrs.get(flag)]
    values = {k: _known(v) for k, v in zip(names, bn.inputs[1:], strict=True)}
    w = _known(conv.inputs[1])
    b = _known(conv.inputs[2]) if len(conv.inputs) == 3 else None
    if w is None or any(v is None for v in values.values()) or (len(conv.inputs) == 3 and b is None):
        return None
    kf = w.shape[0]
    known = {k: v.double() for k, v in values.items() if v is not None}
    mean, var = known["running_mean"], known["running_var"]
    gamma = known.get("weight", torch.ones(kf, dtype=torch.float64))
    beta = known.get("bias", torch.zeros(kf, dtype=torch.float64))
    scale = gamma / torch.sqrt(var + float(bn.attrs.get("eps", 1e-5)))
    new_w = (w.double() * scale.reshape(kf, 1, 1, 1)).to(w.dtype)
    old_b = b.double() if b is not None else torch.zeros(kf, dtype=torch.float64)
    new_b = ((old_b - mean) * scale + beta).to(w.dtype)
    inputs = (conv.inputs[0], _constant(new_w, conv.inputs[1], f"{conv.name}.folded_weight"),
              _constant(new_b, conv.inputs[1], f"{conv.name}.folded_bias"))
    out = conv.replace(inputs=inputs, name=bn.name)
    if out.spec.shape != bn.spec.shape or out.spec.dtype != bn.spec.dtype:
        return None
    return out


@graph_pass("fold_batchnorm")
def fold_batchnorm(graph: Graph) -> Graph:
    """Inference batchnorm with constant parameters after a conv2d with constant weights -> one conv2d."""
    users = graph.users()
    outputs = frozenset(n.id for n in graph.outputs)
    mapping: dict[int, Node] = {}
    changed = False
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        folded = folded_conv(node, users, outputs)
        if folded is not None:
            mapping[node.id] = folded.replace(inputs=(mapping[folded.inputs[0].id], *folded.inputs[1:]))
            changed = True
            continue
        inputs = tuple(mapping[i.id] for i in node.inputs)
        moved = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        mapping[node.id] = node.replace(inputs=inputs) if moved else node
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs)) if changed else graph


# ---- the channels-last choice ----

TENSOR_CORE_DTYPES = ("float16", "bfloat16")
# Which operands of each convolution op are activations (laid out NCHW/NHWC) and whether its
# result is one; the rest are weights (KCRS, channels-last = KRSC) or weight gradients.
CONV_ACTIVATIONS: dict[str, tuple[tuple[int, ...], bool]] = {
    "conv2d": ((0,), True), "conv2d_backward_input": ((0,), True), "conv2d_backward_weight": ((0, 1), False)}
CONV_WEIGHT_OPERAND = {"conv2d": 1, "conv2d_backward_input": 1}


@dataclass
class LayoutDecision:
    """What the layout pass decided for one region (printed with FUSEGRAPH_DEBUG and kept on the pass)."""

    layout: str                                   # "NHWC" or "NCHW"
    convs: list[str]
    nodes: int                                    # values in the region
    entry_copies: list[str] = field(default_factory=list)
    converted_in_conv: list[str] = field(default_factory=list)
    exit_copies: list[str] = field(default_factory=list)
    # KCRS weights that are graph inputs (a model's parameters) with R*S > 1: the convolution call
    # re-lays each out as KRSC (a small copy per call; a channels_last model has none)
    weights_converted_in_conv: list[str] = field(default_factory=list)
    # weights computed in the graph (autocast's cast of an fp32 parameter) that their own kernel writes
    # KRSC instead: no copy in the convolution call (weights_written_nhwc)
    weights_written_nhwc: list[str] = field(default_factory=list)
    boundary_bytes: int = 0                       # what the NHWC choice moves at the edges
    nchw_bytes: int = 0                           # the transposes NCHW tensor-core convolutions cost
    reason: str = ""

    def __str__(self) -> str:
        head = (f"layout: {self.layout} for {len(self.convs)} conv(s) ({', '.join(self.convs)}), region of "
                f"{self.nodes} values; {self.reason}")
        if self.layout != "NHWC":
            return head
        return (f"{head}; copies in: {', '.join(self.entry_copies) or 'none'}; converted inside the conv "
                f"call: {', '.join(self.converted_in_conv) or 'none'}; copies out: "
                f"{', '.join(self.exit_copies) or 'none'}; weights re-laid out inside the conv call: "
                f"{', '.join(self.weights_converted_in_conv) or 'none'}; weights their kernel writes KRSC: "
                f"{', '.join(self.weights_written_nhwc) or 'none'}")


class _Regions:
    """Union-find over node ids: values that must share one memory layout."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, a: int) -> int:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _is_conversion(node: Node) -> bool:
    return bool(get_op(node.op).extra.get("layout_conversion"))


def _activation(node: Node) -> bool:
    return not node.multi_output and node.spec.rank == 4


def already_nhwc(node: Node) -> bool:
    """A 4-D value whose memory is already channels-last (a channels_last user tensor): laying
    it out NHWC costs nothing."""
    spec = node.spec
    if spec.rank != 4 or node.multi_output:
        return False
    return spec.layout == "NHWC" or (spec.strides is not None and
                                     spec.strides == spec.with_(layout="NHWC", strides=None).memory_strides)


def tensor_core_conv(node: Node, allow_tf32: bool) -> bool:
    """A convolution whose cuDNN kernel runs on tensor cores, reading an NCHW (row-major) activation
    or one already laid out channels-last."""
    if node.op not in CONV_ACTIVATIONS or node.multi_output:
        return False
    x = node.inputs[CONV_ACTIVATIONS[node.op][0][0]]
    row_major = x.spec.memory_strides == contiguous_strides(x.spec.shape)   # also explicit row-major strides
    dtype_ok = node.dtype in TENSOR_CORE_DTYPES or (node.dtype == "float32" and allow_tf32)
    return (row_major or already_nhwc(x)) and dtype_ok


def layout_regions(graph: Graph) -> _Regions:
    """Join each convolution with its activations and each same-shape pointwise op with its
    same-shape operands (bias/batchnorm/activation/residual chains); conversions split regions."""
    regions = _Regions()
    for node in graph.nodes:
        if node.multi_output or _is_conversion(node):
            continue
        if node.op in CONV_ACTIVATIONS:
            positions, out_is_activation = CONV_ACTIVATIONS[node.op]
            acts = [node.inputs[k] for k in positions if _activation(node.inputs[k])]
            for a in acts[1:]:
                regions.union(acts[0].id, a.id)
            if out_is_activation and acts:
                regions.union(node.id, acts[0].id)
        elif get_op(node.op).has(POINTWISE) and _activation(node):
            for i in node.inputs:  # a view's layout follows its input's strides: it stays outside
                if i.shape == node.shape and _activation(i) and not _is_conversion(i) and not get_op(i.op).has(VIEW):
                    regions.union(node.id, i.id)
    return regions


def _nhwc(node: Node) -> Node:
    if node.op == "constant":
        value = node.attrs["value"].contiguous(memory_format=torch.channels_last)
        return node.replace(attrs=node.attrs.replace(value=value),
                            specs=(node.spec.with_(layout="NHWC", strides=None),))
    return node.replace(specs=(node.spec.with_(layout="NHWC", strides=None),))


def _conversion(node: Node, layout: str, suffix: str) -> Node:
    spec = node.spec.with_(layout=None if layout == "contiguous" else layout, strides=None)
    return Node(op="to_layout", inputs=(node,), attrs=Attrs(layout=layout), specs=(spec,),
                name=f"{node.name}.{suffix}", source=node.source)


def _view_folds_nhwc(view: Node, value: Node) -> bool:
    """Whether a view op reads an NHWC `value` as a strided view (no copy)."""
    fold = get_op(view.op).extra.get("fold")
    if fold is None:
        return False
    strides = value.spec.with_(layout="NHWC", strides=None).memory_strides
    return fold(value.spec, view.attrs, strides, 0) is not None


def choose_layout(graph: Graph, mode: str = "auto", allow_tf32: bool = False,
                  free_outputs: Collection[int] = ()) -> tuple[Graph, list[LayoutDecision]]:
    """The graph with tensor-core convolution regions in NHWC (see the module doc), and the decisions.
    `free_outputs`: positions of graph outputs the caller takes in whatever layout their region got
    (a training forward's saved activations, which the backward then reads so): no copy back to
    row-major for them."""
    if mode == "NCHW":
        return graph, []
    convs = [n for n in graph.nodes if tensor_core_conv(n, allow_tf32 or mode == "NHWC")]
    if not convs:
        return graph, []
    regions = layout_regions(graph)
    users = graph.users()
    outputs = {n.id for k, n in enumerate(graph.outputs) if k not in free_outputs}   # those copied back
    members: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if _activation(node) and not _is_conversion(node) and node.id in regions.parent:
            members.setdefault(regions.find(node.id), []).append(node)
    chosen: set[int] = set()                      # ids of values to lay out as NHWC
    decisions: list[LayoutDecision] = []
    def root_of(conv: Node) -> int:
        return regions.find(conv.inputs[CONV_ACTIVATIONS[conv.op][0][0]].id)

    for root in dict.fromkeys(root_of(c) for c in convs):
        decision = _decide(members[root], [c for c in convs if root_of(c) == root], users, outputs, mode)
        decisions.append(decision)
        if decision.layout == "NHWC":
            chosen |= {n.id for n in members[root]}
    written = weights_written_nhwc(graph, chosen, users, outputs)
    chosen |= {w.id for w in written}
    for d in decisions:
        d.weights_written_nhwc = [w.name for w in written if w.name in d.weights_converted_in_conv]
        d.weights_converted_in_conv = [n for n in d.weights_converted_in_conv if n not in d.weights_written_nhwc]
        if settings.debug >= 1:
            print(f"[fusegraph] {graph.name}: {d}")
    if not chosen:
        return graph, decisions
    return _relayout(graph, chosen, users, frozenset(free_outputs)), decisions


def _single_conv_reader(node: Node, users: dict[int, list[Node]]) -> bool:
    readers = users.get(node.id, [])
    return (len(readers) == 1 and readers[0].op in CONV_ACTIVATIONS
            and readers[0].inputs.count(node) == 1
            and readers[0].inputs.index(node) in CONV_ACTIVATIONS[readers[0].op][0])


def _decide(region: list[Node], convs: list[Node], users: dict[int, list[Node]], outputs: set[int],
            mode: str) -> LayoutDecision:
    entries = [n for n in region if get_op(n.op).has(SOURCE) and n.op != "constant" and not already_nhwc(n)]
    exits = [n for n in region if n.id in outputs and not already_nhwc(n)]
    boundary = sum(2 * n.spec.nbytes for n in entries + exits)
    nchw = 0
    for c in convs:
        positions, out_is_activation = CONV_ACTIVATIONS[c.op]
        nchw += sum(2 * c.inputs[k].spec.nbytes for k in positions) + (2 * c.spec.nbytes if out_is_activation else 0)
    decision = LayoutDecision("NCHW", [c.name for c in convs], len(region), boundary_bytes=boundary, nchw_bytes=nchw)
    if mode == "NHWC" or boundary <= nchw:
        decision.layout = "NHWC"
        decision.reason = ("forced by build(conv_layout='NHWC')" if mode == "NHWC" else
                           f"boundary copies move {boundary} B <= {nchw} B of NCHW<->NHWC transposes around "
                           "the convolutions")
        decision.entry_copies = [n.name for n in entries if not _single_conv_reader(n, users)]
        decision.converted_in_conv = [n.name for n in entries if _single_conv_reader(n, users)]
        decision.exit_copies = [n.name for n in exits]
        decision.weights_converted_in_conv = list(dict.fromkeys(w.name for w in map(_conv_weight, convs)
                                                                if w is not None and _converted_weight(w)))
    else:
        decision.reason = f"boundary copies would move {boundary} B > {nchw} B of transposes kept in NCHW"
    return decision


def weights_written_nhwc(graph: Graph, chosen: set[int], users: dict[int, list[Node]],
                         outputs: set[int]) -> list[Node]:
    """Weights of NHWC convolutions that a generated kernel computes (autocast's bf16 cast of an fp32
    parameter in a training forward) and that only NHWC convolutions read, as their weight: that
    kernel writes them KRSC (channels-last) instead of KCRS, so the convolution call copies nothing.
    Without this, each KxK weight was converted per call: ResNet-50's training step launched one copy
    per 3x3 convolution in its forward (16, 64.6 us, results/profile_train_resnet50_20261201_2156.txt).
    Not a weight the user gets back (`outputs`: outputs kept in their layout), a view (its layout
    follows its input) or one read by anything else."""
    out: list[Node] = []
    seen: set[int] = set()
    for conv in graph.nodes:
        w = _conv_weight(conv) if conv.id in chosen else None
        if w is None or w.id in seen or not _converted_weight(w) or w.op == "input" or w.id in outputs:
            continue
        seen.add(w.id)
        if not get_op(w.op).has(POINTWISE) or get_op(w.op).has(VIEW):
            continue
        readers = users.get(w.id, [])
        if readers and all(r.id in chosen and r.op in CONV_WEIGHT_OPERAND and r.inputs.count(w) == 1
                           and r.inputs.index(w) == CONV_WEIGHT_OPERAND[r.op] for r in readers):
            out.append(w)
    return out


def _conv_weight(conv: Node) -> Node | None:
    k = CONV_WEIGHT_OPERAND.get(conv.op)
    return conv.inputs[k] if k is not None else None


def _converted_weight(w: Node) -> bool:
    """A KCRS weight read per call (not a constant, which is re-laid out at build time) whose KRSC
    layout differs in memory (R*S > 1; a 1x1 kernel's strides agree)."""
    return (w.op != "constant" and not w.multi_output and w.spec.rank == 4 and w.shape[2] * w.shape[3] > 1
            and not already_nhwc(w))


def _relayout(graph: Graph, chosen: set[int], users: dict[int, list[Node]], free_outputs: frozenset[int]) -> Graph:
    mapping: dict[int, Node] = {}
    entry: dict[int, Node] = {}     # graph input id -> its NHWC copy
    leave: dict[int, Node] = {}     # NHWC value id -> its row-major copy

    def read(consumer: Node, value: Node) -> Node:
        """What `consumer` reads for `value`: the NHWC copy of an input, the row-major copy of an
        NHWC value a view cannot fold, or the (re-laid-out) value itself."""
        new = mapping[value.id]
        if value.id in chosen and value.op == "input" and already_nhwc(value):
            return new                               # a channels_last tensor: read as it is
        if value.id in chosen and value.op == "input" and (consumer.id in chosen or consumer.op in CONV_ACTIVATIONS):
            if _single_conv_reader(value, users):
                return new                           # the convolution converts it inside its call
            if value.id not in entry:
                entry[value.id] = _conversion(new, "NHWC", "nhwc")
            return entry[value.id]
        if value.id in chosen and value.op != "input" and get_op(consumer.op).has(VIEW) \
                and not _view_folds_nhwc(consumer, value):
            if value.id not in leave:
                leave[value.id] = _conversion(new, "contiguous", "nchw")
            return leave[value.id]
        return new

    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = tuple(read(node, i) for i in node.inputs)
        if node.op in CONV_WEIGHT_OPERAND and node.id in chosen:
            k = CONV_WEIGHT_OPERAND[node.op]
            if inputs[k].op == "constant" and inputs[k].spec.rank == 4:
                inputs = (*inputs[:k], _nhwc(inputs[k]), *inputs[k + 1:])  # KRSC at build time
        changed = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        new = node.replace(inputs=inputs) if changed else node
        mapping[node.id] = _nhwc(new) if node.id in chosen else new
    outs = []
    for k, o in enumerate(graph.outputs):
        new = mapping[o.id]
        # NHWC already in the user's graph, or an output the caller takes in any layout: kept
        if o.id in chosen and o.op != "input" and not already_nhwc(o) and k not in free_outputs:
            new = leave.get(o.id) or _conversion(new, "contiguous", "nchw")
            leave[o.id] = new
        outs.append(new)
    return graph.with_(outputs=tuple(outs))


def layout_pass(mode: str = "auto", allow_tf32: bool = False, free_outputs: Collection[int] = ()) -> Pass:
    """The `layout` pass for build(): choose_layout with the build's conv_layout, allow_tf32 and
    layout_outputs options."""
    if mode not in ("auto", "NHWC", "NCHW"):
        from ..errors import InvalidValueError
        raise InvalidValueError(f"build option conv_layout={mode!r}: use 'auto', 'NHWC' or 'NCHW'")
    return Pass("layout", lambda graph: choose_layout(graph, mode, allow_tf32, free_outputs)[0],
                "NHWC for tensor-core convolutions and the pointwise chains around them, one copy per "
                "graph boundary")
