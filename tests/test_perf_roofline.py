"""Cost numbers of known ops (exact), floors and bounds of kernels on a given device spec."""

from __future__ import annotations

import pytest

import fusegraph as fg
from fusegraph.ir.registry import get_op
from fusegraph.perf.devices import get_device
from fusegraph.perf.roofline import LATENCY_BOUND_US, kernel_floor, tensor_core_work
from perf_helpers import kernel, value

H200 = get_device("H200")


def op_cost(handle):  # the registry's cost of the node behind a Graph handle
    node = handle.node
    return get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)


def test_layernorm_bytes_and_flops_exact() -> None:
    m, n = 64, 256
    g = fg.Graph()
    x = g.tensor((m, n), "bfloat16")
    w, b = g.tensor((n,), "bfloat16"), g.tensor((n,), "bfloat16")
    cost = op_cost(g.layernorm(x, weight=w, bias=b))
    assert cost.bytes == 2 * m * n * 2 + 2 * n * 2  # x read, y written, w and b read: bf16
    assert cost.flops == 8 * m * n


def test_softmax_bytes_exact() -> None:
    g = fg.Graph()
    cost = op_cost(g.softmax(g.tensor((128, 512), "bfloat16"), -1))
    assert cost.bytes == 2 * 128 * 512 * 2 and cost.flops == 5 * 128 * 512


def test_matmul_flops_exact() -> None:
    m, k, n = 64, 128, 32
    g = fg.Graph()
    a, b = g.tensor((m, k), "bfloat16"), g.tensor((k, n), "bfloat16")
    out = g.matmul(a, b)
    cost = op_cost(out)
    assert cost.flops == 2 * m * n * k
    assert cost.bytes == (m * k + k * n + m * n) * 2
    batched = op_cost(g.matmul(g.tensor((3, m, k), "float16"), g.tensor((k, n), "float16")))
    assert batched.flops == 3 * 2 * m * n * k
    # the roofline charges a matmul node's FLOPs to the bf16 tensor cores
    k0 = kernel("mm", cost.bytes, cost.flops, kind="reference", inputs=(a.node, b.node), outputs=(out.node,),
                nodes=(out.node,))
    assert tensor_core_work(k0) == (2 * m * n * k, "bf16")


def test_conv_and_causal_attention_flops_exact() -> None:
    g = fg.Graph()
    conv = op_cost(g.conv2d(g.tensor((2, 8, 10, 10), "float32"), g.tensor((4, 8, 3, 3), "float32"), padding=1))
    assert conv.flops == 2 * 2 * 4 * 10 * 10 * 8 * 9  # 2 * N * K * H * W * C * R * S
    b, h, s, d = 1, 2, 64, 32
    q, k, v = (g.tensor((b, h, s, d), "float16") for _ in range(3))
    attn = op_cost(g.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert attn.flops == 2 * b * h * s * s * d  # BENCHMARKS.md's count for causal attention
    assert attn.bytes == 4 * b * h * s * d * 2  # q, k, v read, out written, fp16


def test_memory_bound_floor_is_bytes_over_bandwidth() -> None:
    f = kernel_floor(kernel("copy", 10**9), H200)
    assert f.seconds == pytest.approx(1e9 / 4.8e12) and f.bound == "memory" and f.compute_s == 0.0


def test_compute_bound_floor_uses_tensor_rate() -> None:
    size = 8192
    f = kernel_floor(kernel("gemm", 3 * size * size * 2, 2 * size**3, kind="matmul",
                            inputs=(value("a", size * size, "bfloat16"),)), H200)
    assert f.bound == "compute" and f.rate_key == "bf16"
    assert f.seconds == pytest.approx(2 * size**3 / 989.4e12)


def test_non_matmul_flops_run_at_fp32_rate() -> None:
    f = kernel_floor(kernel("math", 1000, 10**12), H200)  # few bytes, many CUDA-core FLOPs
    assert f.rate_key == "fp32" and f.seconds == pytest.approx(1e12 / 67e12) and f.bound == "compute"


def test_tiny_kernel_is_latency_bound() -> None:
    f = kernel_floor(kernel("tiny", 4096), H200)
    assert f.seconds * 1e6 < LATENCY_BOUND_US and f.bound == "latency"
