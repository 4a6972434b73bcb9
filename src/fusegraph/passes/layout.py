"""Layout passes for convolution chains.

`fold_batchnorm`: inference batchnorm after a convolution whose weights and batchnorm parameters
are known at build time (constants) becomes part of the convolution: w' = w * s and
b' = (b - mean) * s + beta with s = gamma / sqrt(var + eps), per output channel, computed once
here in fp32 and rounded to the weight dtype. The batchnorm then costs nothing at run time. With
parameters that are graph inputs the batchnorm stays and becomes the convolution kernel's
epilogue (fusion/epilogue.py), which reads the four per-channel vectors once per tile.

Layout: a convolution's output keeps its input's layout (ops/conv.py), and the epilogue kernel
reads and writes in that layout, so an NHWC input gives an NHWC chain with no transposes; the
cuDNN call takes channels-last operands (backends/cudnn.py).
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from ..ir.node import Attrs, Node
from ..ir.spec import TensorSpec
from .base import graph_pass


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
