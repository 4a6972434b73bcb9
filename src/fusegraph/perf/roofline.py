"""The roofline model: a kernel's floor is max(bytes / bandwidth, FLOPs / peak), and which term
wins (or that the floor is too short to matter next to a launch) is its bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.registry import MATMUL, get_op
from .devices import DeviceSpec

# A kernel whose floor is under this many microseconds is bound by launch and latency, not by
# bytes or FLOPs: a launch alone costs about as much.
LATENCY_BOUND_US = 4.0

TENSOR_CORE_KINDS = ("matmul", "convolution", "conv", "attention")

# dtype of a tensor-core operand -> the rate key of the unit that multiplies it.
_RATE_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "tf32", "float64": "fp32",
                  "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "int8": "int8"}


@dataclass(frozen=True)
class Floor:
    bytes: int
    flops: int
    tensor_flops: int         # FLOPs on tensor cores (matmul-like nodes); the rest run on CUDA cores
    rate_key: str             # tensor-core rate used ('bf16', 'tf32', ...) or 'fp32'
    memory_s: float
    compute_s: float
    bound: str                # memory | compute | latency

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else float("inf")


def _node_cost_flops(node: Any) -> int:
    opdef = get_op(node.op)
    return int(opdef.cost([i.spec for i in node.inputs], list(node.specs), node.attrs).flops)


def rate_key_of(dtype: str) -> str:
    """The peak-rate key of a matmul on `dtype` operands: float32 runs on the tensor cores (TF32)
    only when torch allows it (set_float32_matmul_precision 'high'/'medium'); at 'highest' our
    GEMMs and cuBLAS use the CUDA cores, whose fp32 rate is the floor."""
    if dtype == "float32" and torch.get_float32_matmul_precision() == "highest":
        return "fp32"
    return _RATE_OF_DTYPE.get(dtype, "bf16")


def tensor_core_work(kernel: Any) -> tuple[int, str | None]:
    """(FLOPs of the kernel's matmul-like nodes, their rate key), from the op registry's MATMUL
    property and each node's cost; a matmul/conv/attention kernel whose nodes say nothing counts
    all of its FLOPs."""
    flops, key = 0, None
    for node in kernel.nodes:
        try:
            if not get_op(node.op).has(MATMUL):
                continue
            flops += _node_cost_flops(node)
            key = key or rate_key_of(node.inputs[0].dtype)
        except Exception:  # a node we cannot cost individually: the kernel's total stands
            continue
    if flops == 0 and kernel.kind in TENSOR_CORE_KINDS:
        dtype = next((n.dtype for n in kernel.inputs if not n.multi_output), "bfloat16")
        return int(kernel.cost.flops), rate_key_of(dtype)
    return min(flops, int(kernel.cost.flops)), key


def floor_of(nbytes: int, flops: int, tensor_flops: int, rate_key: str | None, spec: DeviceSpec) -> Floor:
    memory_s = nbytes / spec.bandwidth
    key = rate_key if rate_key and spec.has_rate(rate_key) else ("bf16" if tensor_flops else "fp32")
    compute_s = 0.0
    if tensor_flops:
        compute_s += tensor_flops / spec.rate(key)
    if flops - tensor_flops > 0:
        compute_s += (flops - tensor_flops) / spec.rate("fp32")
    seconds = max(memory_s, compute_s)
    if seconds * 1e6 < LATENCY_BOUND_US:
        bound = "latency"
    else:
        bound = "memory" if memory_s >= compute_s else "compute"
    return Floor(int(nbytes), int(flops), int(tensor_flops), key if tensor_flops else "fp32", memory_s,
                 compute_s, bound)


def kernel_floor(kernel: Any, spec: DeviceSpec, nbytes: int | None = None) -> Floor:
    """The kernel's floor on `spec`; `nbytes` overrides the kernel's min bytes (what-if L2 model)."""
    tensor_flops, key = tensor_core_work(kernel)
    return floor_of(int(kernel.cost.bytes if nbytes is None else nbytes), int(kernel.cost.flops),
                    tensor_flops, key, spec)


def ops_with_sources(kernel: Any) -> list[str]:
    """The ops the kernel fused, grouped by the user's source line: 'file:line: op, op x2, op'."""
    groups: list[tuple[str, list[str]]] = []
    for node in kernel.nodes:
        src = getattr(node, "source", "") or "?"
        if not groups or groups[-1][0] != src:
            groups.append((src, []))
        ops = groups[-1][1]
        if ops and (ops[-1] == node.op or ops[-1].startswith(node.op + " x")):
            count = int(ops[-1].split(" x")[1]) + 1 if " x" in ops[-1] else 2
            ops[-1] = f"{node.op} x{count}"
        else:
            ops.append(node.op)
    return [f"{src}: {', '.join(ops)}" for src, ops in groups]


def user_lines(kernel: Any) -> list[str]:
    """The distinct user source lines whose ops this kernel fused, in order."""
    seen: list[str] = []
    for node in kernel.nodes:
        src = getattr(node, "source", "")
        if src and src not in seen:
            seen.append(src)
    return seen


def classify_measured(floor: Floor, measured_s: float | None) -> str:
    """The bound, with 'latency' also for kernels whose measured time is dominated by launch."""
    if measured_s is not None and measured_s * 1e6 < LATENCY_BOUND_US:
        return "latency"
    return floor.bound
