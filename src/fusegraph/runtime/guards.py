"""Checks on what a user feeds a graph: every input present, nothing extra, right shape/dtype/device."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ExecutionError, where
from ..ir import dtypes
from ..ir.node import Node


def resolve_feeds(inputs: Sequence[Node], feeds: Mapping[Any, Any]) -> list[torch.Tensor]:
    """Map a feed dict (keys: handles, input Nodes or input names) to tensors in input order."""
    if not isinstance(feeds, Mapping):
        raise ExecutionError(f"execute takes a dict {{input handle or name: tensor}}, got {type(feeds).__name__}; "
                             "to pass tensors in declaration order, call the plan: plan(*tensors)")
    by_id = {n.id: k for k, n in enumerate(inputs)}
    by_name = {n.name: k for k, n in enumerate(inputs)}
    names = ", ".join(n.name for n in inputs)
    out: list[Any] = [None] * len(inputs)
    fed = [False] * len(inputs)
    for key, value in feeds.items():
        node = getattr(key, "node", key)
        if isinstance(node, Node):
            k = by_id.get(node.id)
            label = where(node.op, node.name, node.source)
        else:
            k = by_name.get(key) if isinstance(key, str) else None
            label = f"feed {key!r}"
        if k is None:
            raise ExecutionError(f"{label}: not an input of this graph (inputs: {names})")
        if fed[k]:
            raise ExecutionError(f"{where('input', inputs[k].name, inputs[k].source)}: fed twice (by handle "
                                 "and by name?)")
        out[k], fed[k] = value, True
    missing = [where("input", n.name, n.source) for n, f in zip(inputs, fed, strict=True) if not f]
    if missing:
        raise ExecutionError(f"missing feeds for: {'; '.join(missing)}")
    return out


def check_inputs(inputs: Sequence[Node], values: Sequence[Any], device: str | None = None) -> None:
    """Raise ExecutionError naming the input and the offending value when a feed does not fit."""
    if len(values) != len(inputs):
        raise ExecutionError(f"expected {len(inputs)} input tensors in declaration order "
                             f"({', '.join(n.name for n in inputs)}), got {len(values)}")
    for node, value in zip(inputs, values, strict=True):
        label = where("input", node.name, node.source)
        if not isinstance(value, torch.Tensor):
            raise ExecutionError(f"{label}: expected a torch.Tensor, got {type(value).__name__}: {value!r:.60}")
        if tuple(value.shape) != node.shape:
            raise ExecutionError(f"{label}: expected shape {node.shape}, got {tuple(value.shape)}")
        if value.dtype != dtypes.to_torch(node.dtype):
            raise ExecutionError(f"{label}: expected dtype {node.dtype}, got {dtypes.canonical(value.dtype)}")
        if device is not None and value.device.type != torch.device(device).type:
            raise ExecutionError(f"{label}: expected a tensor on {device}, got one on {value.device}")


class FastInputCheck:
    """The per-call input check's fast path: Dynamo's C++ tensor guard (torch._C._dynamo.guards.
    TensorGuards: dispatch keys, dtype, device, requires_grad, sizes and strides of every input in one
    call), armed from the first call that passed the Python checks. A call it rejects (another
    signature, or only requires_grad differs) goes through the Python checks, so it is never the only
    judge; where torch has no such guard, `check` stays a function that always says no. The input
    checks of a 16-input plan: 1.6 us per call with it, 6.9 with the Python checks alone (this
    machine's CPU, bench/host_call_cpu.py)."""

    def __init__(self) -> None:
        self.check: Any = self._never     # the generated run() calls check(*inputs)
        self.armed = False

    @staticmethod
    def _never(*inputs: Any) -> bool:
        return False

    def arm(self, inputs: Sequence[Any]) -> None:
        """Build the guard from inputs the Python checks accepted (once; a failure leaves it off)."""
        if self.armed:
            return
        self.armed = True
        try:
            from torch._C._dynamo.guards import TensorGuards

            if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
                return
            sizes: Any = [list(t.shape) for t in inputs]     # per input: every dim static
            strides: Any = [list(t.stride()) for t in inputs]
            guard = TensorGuards(*inputs, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
            if guard.check(*inputs):
                self.check = guard.check
        except Exception:  # an internal API: where it differs, the Python checks do the work
            self.check = self._never
