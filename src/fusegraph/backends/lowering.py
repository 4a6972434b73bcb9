"""The lowering table of compute-bound single nodes, by the op's extra["kernel_kind"]: consulted
by lower.py before the reference fallback. (Matmuls and convolutions arrive as
MatmulGroup/ConvGroup with their epilogue: backends/matmul_kernel.py, backends/conv_kernel.py.)"""

from __future__ import annotations

from collections.abc import Callable

from ..ir.node import Node
from ..ir.registry import get_op
from ..runtime.kernel import Kernel

NodeLowering = Callable[[Node, str, str, str], Kernel]


def _attention(node: Node, name: str, compute_dtype: str, device: str) -> Kernel:
    from .attention_kernel import attention_kernel

    return attention_kernel(node, name, compute_dtype, device)


LOWERINGS: dict[str, NodeLowering] = {
    "attention": _attention,
    "attention_backward": _attention,
}


def compute_node_kernel(node: Node, name: str, compute_dtype: str, device: str) -> Kernel | None:
    """The kernel of a compute-bound node, or None when its kind has no lowering here."""
    lowering = LOWERINGS.get(str(get_op(node.op).extra.get("kernel_kind", "")))
    return None if lowering is None else lowering(node, name, compute_dtype, device)
