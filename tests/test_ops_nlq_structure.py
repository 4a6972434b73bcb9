"""Norms / losses / dropout / quantization: typed errors, the structure of the decompositions,
costs, and the Triton expression hooks of iota and rand_uniform (run under TRITON_INTERPRET=1,
bit-exact against the reference)."""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import rand
from fusegraph.errors import InvalidValueError
from fusegraph.ir.registry import COMPOSITE, REDUCTION, all_ops, get_op
from fusegraph.passes import cse, dce
from fusegraph.passes.decompose import decompose
from fusegraph.reference import execute_graph
from test_ops_norm_loss_quant import uniform_np

# ---------------------------------------------------------------- typed errors


def _g() -> fg.Graph:
    return fg.Graph(name="errors")


def _bn_weight(g: fg.Graph) -> Any:
    return g.batch_norm(g.tensor((2, 3, 4)), None, None, g.tensor((4,)), training=True)


def _scale_const_zero(g: fg.Graph) -> Any:
    return g.quantize(g.tensor((4, 8)), "int8", "row", scale=g.constant(torch.tensor([[1.0], [0.0], [2.0], [1.0]])))


ERRORS: list[tuple[str, Callable[[fg.Graph], Any], type[Exception], list[str]]] = [
    ("bn_weight_shape", _bn_weight, fg.ShapeError, ["(op batchnorm)", "weight has shape (4,)", "(3,)"]),
    ("bn_one_value_per_channel", lambda g: g.batch_norm(g.tensor((1, 3)), None, None, training=True),
     fg.ShapeError, ["more than one value", "(1, 3)"]),
    ("bn_one_running_stat", lambda g: g.batch_norm(g.tensor((2, 3)), g.tensor((3,)), None), fg.ShapeError,
     ["op batchnorm", "running_var"]),
    ("bn_int_input", lambda g: g.batch_norm(g.tensor((2, 3), "int32"), None, None), fg.DTypeError, ["int32"]),
    ("gn_groups", lambda g: g.group_norm(g.tensor((2, 6, 5)), 4), fg.ShapeError, ["(op groupnorm)", "num_groups 4"]),
    ("gn_rank1", lambda g: g.group_norm(g.tensor((6,)), 2), fg.ShapeError, ["[N, C, *spatial]", "(6,)"]),
    ("ln_alias_bad_shape", lambda g: g.layer_norm(g.tensor((3, 5)), (4,)), fg.ShapeError, ["(4,)", "(3, 5)"]),
    ("ln_backward_grad_shape", lambda g: g.layernorm_backward(g.tensor((3, 4)), g.tensor((3, 5))), fg.ShapeError,
     ["(op layernorm_backward)", "grad_out has shape (3, 4)", "(3, 5)"]),
    ("rms_backward_weight", lambda g: g.rmsnorm_backward(g.tensor((3, 5)), g.tensor((3, 5)), weight=g.tensor((3,))),
     fg.ShapeError, ["weight has shape (3,)"]),
    ("bn_backward_int", lambda g: g.batchnorm_backward(g.tensor((4, 3)), g.tensor((4, 3), "int64")),
     fg.DTypeError, ["int64"]),
    ("gn_backward_groups", lambda g: g.groupnorm_backward(g.tensor((2, 6)), g.tensor((2, 6)), 5), fg.ShapeError,
     ["num_groups 5"]),
    ("ce_float_target", lambda g: g.cross_entropy(g.tensor((4, 3)), g.tensor((4,))), fg.DTypeError,
     ["(op cross_entropy)", "float32"]),
    ("ce_target_shape", lambda g: g.cross_entropy(g.tensor((4, 3)), g.tensor((3,), "int64")), fg.ShapeError,
     ["target has shape (3,)", "(4,)"]),
    ("ce_reduction", lambda g: g.cross_entropy(g.tensor((4, 3)), g.tensor((4,), "int64"), reduction="avg"),
     InvalidValueError, ["'avg'"]),
    ("ce_smoothing", lambda g: g.cross_entropy(g.tensor((4, 3)), g.tensor((4,), "int64"), label_smoothing=1.5),
     InvalidValueError, ["1.5"]),
    ("ce_weight", lambda g: g.cross_entropy(g.tensor((4, 3)), g.tensor((4,), "int64"), g.tensor((3,))),
     fg.UnsupportedError, ["class weights"]),
    ("ce_backward_grad", lambda g: g.cross_entropy_backward(g.tensor((4,)), g.tensor((4, 3)),
                                                            g.tensor((4,), "int64")),
     fg.ShapeError, ["grad has shape (4,)", "()"]),
    ("dropout_p", lambda g: g.dropout(g.tensor((3,)), 1.5), InvalidValueError, ["(op dropout)", "1.5"]),
    ("dropout_p_eval", lambda g: g.dropout(g.tensor((3,)), -0.1, training=False), InvalidValueError, ["-0.1"]),
    ("dropout_seed", lambda g: g.dropout(g.tensor((3,)), 0.1, seed=-1), InvalidValueError, ["seed", "-1"]),
    ("dropout_int", lambda g: g.dropout(g.tensor((3,), "int32"), 0.1), fg.DTypeError, ["int32"]),
    ("rand_too_many", lambda g: g.rand_uniform((2 ** 16, 2 ** 16 + 1)), fg.ShapeError, ["2**32"]),
    ("iota_dim", lambda g: g.iota((3, 4), 2), fg.ShapeError, ["(op iota)", "dim 2"]),
    ("iota_bool", lambda g: g.iota((3,), 0, "bool"), fg.DTypeError, ["bool"]),
    ("iota_inexact", lambda g: g.iota((4096,), 0, "float16"), fg.DTypeError, ["4096", "float16"]),
    ("q_scale_nan", lambda g: g.quantize(g.tensor((4, 8)), "int8", scale=float("nan")), InvalidValueError,
     ["(op quantize)", "nan"]),
    ("q_scale_inf", lambda g: g.quantize(g.tensor((4, 8)), "float8_e4m3fn", scale=math.inf), InvalidValueError,
     ["inf"]),
    ("q_scale_zero", lambda g: g.quantize(g.tensor((4, 8)), "int8", scale=0.0), InvalidValueError, ["0.0"]),
    ("q_scale_negative", lambda g: g.quantize(g.tensor((4, 8)), "int8", scale=-2), InvalidValueError, ["-2"]),
    ("q_scale_constant_zero", _scale_const_zero, InvalidValueError, ["quantize", "[0.0]"]),
    ("dq_scale_nan", lambda g: g.dequantize(g.tensor((4, 8), "int8"), float("nan")), InvalidValueError,
     ["(op dequantize)", "nan"]),
    ("q_dtype", lambda g: g.quantize(g.tensor((4, 8)), "float16"), fg.DTypeError, ["float16"]),
    ("q_int_input", lambda g: g.quantize(g.tensor((4, 8), "int32"), "int8"), fg.DTypeError, ["int32"]),
    ("q_block", lambda g: g.quantize(g.tensor((4, 8)), "int8", "block", block_size=3), fg.ShapeError,
     ["block_size 3", "(4, 8)"]),
    ("q_granularity", lambda g: g.quantize(g.tensor((4, 8)), "int8", "column"), InvalidValueError, ["'column'"]),
    ("q_number_scale_rows", lambda g: g.quantize(g.tensor((4, 8)), "int8", "row", scale=0.5), fg.ShapeError,
     ["(4, 1)"]),
    ("q_scale_tensor_shape", lambda g: g.quantize(g.tensor((4, 8)), "int8", "row", scale=g.tensor((4,))),
     fg.ShapeError, ["scale has shape (4,)", "(4, 1)"]),
    ("dq_float_input", lambda g: g.dequantize(g.tensor((4, 8)), 0.5), fg.DTypeError, ["float32"]),
    ("dq_to_fp8", lambda g: g.dequantize(g.tensor((4, 8), "int8"), 0.5, dtype="float8_e5m2"), fg.DTypeError,
     ["float8_e5m2"]),
]


@pytest.mark.parametrize(("build", "error", "fragments"), [pytest.param(b, e, f, id=i) for i, b, e, f in ERRORS])
def test_typed_errors(build: Callable[[fg.Graph], Any], error: type[Exception], fragments: list[str]) -> None:
    with pytest.raises(error) as info:
        build(_g())
    assert isinstance(info.value, fg.FusegraphError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "test_ops_nlq_structure.py" in message, f"the user's line is missing from {message!r}"


def test_invalid_value_error_is_a_value_error() -> None:
    assert issubclass(InvalidValueError, ValueError) and issubclass(InvalidValueError, fg.FusegraphError)


# ---------------------------------------------------------------- decomposition structure

def _decomposed(g: fg.Graph) -> Any:
    return decompose(g.to_ir())


def _reductions(graph: Any) -> list[tuple[str, tuple[int, ...] | None]]:
    return [(n.op, n.attrs.get("dims")) for n in graph.nodes if get_op(n.op).has(REDUCTION)]


def test_layernorm_backward_is_row_and_column_sums_only() -> None:
    g = fg.Graph(name="ln_bwd", compute_dtype="float32")
    dy, x, w = g.tensor((64, 96), "bfloat16"), g.tensor((64, 96), "bfloat16"), g.tensor((96,), "bfloat16")
    dx, dw, db = g.layernorm_backward(dy, x, 96, w)
    g.set_output(dx, dw, db)
    graph = _decomposed(g)
    assert not any(get_op(n.op).has(COMPOSITE) for n in graph.nodes)
    assert "reshape" not in {n.op for n in graph.nodes}
    sums = Counter(_reductions(graph))
    # mean(x), mean(centered^2), mean(g), mean(g * xhat) per row; sum(dy * xhat), sum(dy) per column
    assert sums == Counter({("sum", (1,)): 4, ("sum", (0,)): 2})
    assert [o.dtype for o in graph.outputs] == ["bfloat16"] * 3
    # dx alone needs only the four row reductions once the unused outputs are dropped
    g2 = fg.Graph(name="ln_bwd_dx")
    dy2, x2 = g2.tensor((8, 16)), g2.tensor((8, 16))
    g2.set_output(g2.layernorm_backward(dy2, x2)[0])
    assert Counter(_reductions(dce(_decomposed(g2)))) == Counter({("sum", (1,)): 4})


def test_cross_entropy_decomposes_to_one_max_and_sums_with_iota() -> None:
    g = fg.Graph(name="ce")
    loss = g.cross_entropy(g.tensor((32, 50), "bfloat16"), g.tensor((32,), "int64"))
    loss.set_output()
    graph = _decomposed(g)
    ops = Counter(n.op for n in graph.nodes)
    assert ops["iota"] == 1 and ops["max"] == 1 and ops["exp"] == 1 and ops["log"] == 1
    # sum(exp), target logit, total loss, count of non-ignored rows
    assert sorted(_reductions(graph), key=str) == sorted(
        [("max", (1,)), ("sum", (1,)), ("sum", (1,)), ("sum", None), ("sum", None)], key=str)


def test_dropout_is_one_hash_and_a_select() -> None:
    g = fg.Graph(name="drop")
    g.dropout(g.tensor((7, 9)), 0.25, seed=3).set_output()
    ops = Counter(n.op for n in _decomposed(g).nodes)
    assert ops["rand_uniform"] == 1 and ops["ge"] == 1 and ops["where"] == 1 and ops["mul"] == 1


def test_block_quantize_reduces_the_block_axis_of_a_view() -> None:
    g = fg.Graph(name="q")
    q, s = g.quantize(g.tensor((4, 256), "bfloat16"), "float8_e4m3fn", "block", block_size=128)
    g.set_output(q, s)
    graph = _decomposed(g)
    assert _reductions(graph) == [("max", (2,))]
    assert sorted(n.attrs["shape"] for n in graph.nodes if n.op == "reshape") == [(4, 2), (4, 2, 128), (4, 256)]
    assert (q.shape, s.shape, q.dtype, s.dtype) == ((4, 256), (4, 2), "float8_e4m3fn", "float32")


def test_equal_random_streams_are_merged_by_cse_and_different_ones_are_not() -> None:
    g = fg.Graph(name="rng")
    a = g.rand_uniform((5, 6), seed=1)
    b = g.rand_uniform((5, 6), seed=1)
    c = g.rand_uniform((5, 6), seed=2)
    g.set_output(g.add(a, b), c)
    graph = cse(g.to_ir())
    assert Counter(n.op for n in graph.nodes)["rand_uniform"] == 2
    total, other = execute_graph(graph, [])
    assert torch.equal(total, 2 * uniform_np((5, 6), 1))
    assert not torch.equal(other, uniform_np((5, 6), 1))


def test_dropout_keeps_about_one_minus_p_and_streams_differ_by_seed_and_offset() -> None:
    x = torch.ones(64, 64)
    g = fg.Graph(name="rate")
    h = g.tensor_like(x)
    g.set_output(g.dropout(h, 0.3, seed=7), g.dropout(h, 0.3, seed=8), g.dropout(h, 0.3, seed=7, offset=1))
    a, b, c = fg.reference(g)(x)
    assert abs((a > 0).float().mean().item() - 0.7) < 0.03
    assert torch.allclose(a[a > 0], torch.full_like(a[a > 0], 1 / 0.7))
    assert not torch.equal(a, b)
    assert torch.equal(a.flatten()[1:], c.flatten()[:-1])  # offset shifts the stream by one index


def test_dropout_backward_is_dropout_of_the_gradient_with_the_same_seed() -> None:
    x, grad = rand(9, 14), rand(9, 14)
    g = fg.Graph(name="drop_bwd")
    hx, hg = g.tensor_like(x), g.tensor_like(grad)
    g.set_output(g.dropout(hx, 0.4, seed=21), g.dropout(hg, 0.4, seed=21))
    y, dx = fg.reference(g)(x, grad)
    leaf = x.clone().requires_grad_(True)
    keep = uniform_np((9, 14), 21) >= 0.4
    torch.where(keep, leaf / 0.6, 0.0).backward(grad)
    assert torch.equal(y, torch.where(keep, x * (1 / 0.6), 0.0))
    assert torch.allclose(dx, leaf.grad, rtol=1e-6, atol=0)


def test_rms_norm_alias_defaults_eps_to_the_dtype_epsilon() -> None:
    g = fg.Graph(name="rms_eps")
    y = g.rms_norm(g.tensor((4, 8), "bfloat16"), (8,))
    assert y.node.attrs["eps"] == torch.finfo(torch.bfloat16).eps


def test_costs_are_minimum_bytes() -> None:
    g = fg.Graph(name="costs")
    x, w = g.tensor((8, 3, 5, 5), "bfloat16"), g.tensor((3,), "float32")
    y = g.batch_norm(x, None, None, w, training=True)[0]
    q = g.quantize(g.tensor((16, 256), "bfloat16"), "int8", "row")[0]
    loss = g.cross_entropy(g.tensor((32, 100), "bfloat16"), g.tensor((32,), "int64"))
    it = g.iota((10, 4), 1)
    for handle, expected_bytes in ((y, 8 * 3 * 25 * 2 * 2 + 3 * 4 + 3 * 4 * 2), (q, 16 * 256 * 3 + 16 * 4),
                                   (loss, 32 * 100 * 2 + 32 * 8 + 2), (it, 10 * 4 * 8)):
        node = handle.node.inputs[0] if handle.node.op == "getitem" else handle.node
        cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
        assert cost.bytes == expected_bytes, node.op
        assert cost.flops >= (0 if node.op == "iota" else node.inputs[0].spec.numel), node.op


def test_every_composite_here_decomposes_and_is_documented() -> None:
    mine = ["batchnorm", "groupnorm", "layernorm_backward", "rmsnorm_backward", "batchnorm_backward",
            "groupnorm_backward", "cross_entropy", "cross_entropy_backward", "dropout", "quantize", "dequantize"]
    ops = all_ops()
    for name in mine:
        assert ops[name].has(COMPOSITE) and ops[name].decompose is not None and ops[name].doc, name
    for name in ("iota", "rand_uniform"):
        assert not ops[name].has(COMPOSITE) and ops[name].triton is not None and ops[name].extra["generator"]


def test_generators_follow_the_device_of_the_inputs() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = rand(3, 4, device=device)
    g = fg.Graph(name="dev")
    h = g.tensor_like(x)
    g.set_output(g.add(h, g.rand_uniform((3, 4), seed=1)), g.add(h, g.iota((3, 4), 1, "float32")))
    a, b = fg.reference(g)(x)
    assert a.device.type == device and b.device.type == device


# ---------------------------------------------------------------- Triton hooks, interpreted

def _load_kernel(body: str, params: str) -> Any:
    """Compile a one-program Triton kernel from source (Triton's JIT needs it in a file)."""
    src = ("import triton\nimport triton.language as tl\n\n@triton.jit\n"
           f"def kernel({params}, BLOCK: tl.constexpr):\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    path = os.path.join(tempfile.mkdtemp(prefix="fg_nlq_"), "generated_kernel.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("generated_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


@pytest.mark.parametrize(("seed", "offset", "index_dtype"), [(0, 0, "int32"), (1234, 77, "int64"),
                                                              (2 ** 32 - 1, 2 ** 31 + 5, "int64")])
def test_rand_uniform_triton_expression_is_bit_exact(seed: int, offset: int, index_dtype: str) -> None:
    pytest.importorskip("triton")
    import triton

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    shape = (37, 29)
    attrs = {"shape": shape, "seed": seed, "offset": offset}
    expr = get_op("rand_uniform").triton(["lin"], attrs)
    kernel = _load_kernel(f"lin = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.{index_dtype})\n"
                          f"tl.store(out_ptr + lin, {expr}, mask=lin < n)", "out_ptr, n")
    n = shape[0] * shape[1]
    out = torch.empty(shape, dtype=torch.float32, device=device)
    kernel[(triton.cdiv(n, 256),)](out, n, BLOCK=256)
    g = fg.Graph(name="rand")
    g.rand_uniform(shape, seed=seed, offset=offset).set_output()
    reference = fg.reference(g)()
    assert torch.equal(out.cpu(), reference.cpu())
    assert torch.equal(reference.cpu(), uniform_np(shape, seed, offset))
    assert reference.min().item() >= 0.0 and reference.max().item() < 1.0


def test_iota_triton_expression_uses_the_index_of_its_dim() -> None:
    pytest.importorskip("triton")
    import triton

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1")
    shape = (6, 10)
    out = torch.empty(shape, dtype=torch.int64)
    expr = get_op("iota").triton(["cols"], {"shape": shape, "dim": 1, "dtype": "int64"})
    assert get_op("iota").extra["index_dim_attr"] == "dim"
    kernel = _load_kernel(f"rows = tl.arange(0, BLOCK)[:, None]\ncols = tl.arange(0, BLOCK)[None, :]\n"
                          f"mask = (rows < R) & (cols < C)\n"
                          f"tl.store(out_ptr + rows * C + cols, {expr} + rows * 0, mask=mask)", "out_ptr, R, C")
    kernel[(1,)](out, shape[0], shape[1], BLOCK=16)
    g = fg.Graph(name="iota")
    g.iota(shape, 1).set_output()
    assert torch.equal(out, fg.reference(g)())
    assert triton is not None


def _pointwise_kernel_source(graph: Any) -> tuple[str, list[str]]:
    """A tiny pointwise code generator over the ops' triton hooks (the contract the real one uses):
    one linear index `lin`; inputs loaded contiguously; iota gets its dim's index from `lin`."""
    names: dict[int, str] = {}
    lines, params = [], []
    for k, node in enumerate(graph.nodes):
        var = f"v{k}"
        opdef = get_op(node.op)
        if node.op == "input":
            params.append(f"{var}_ptr")
            lines.append(f"{var} = tl.load({var}_ptr + lin, mask=lin < n)")
        elif node.op == "iota":
            shape, dim = node.attrs["shape"], node.attrs["dim"] % len(node.attrs["shape"])
            stride = math.prod(shape[dim + 1:])
            lines.append(f"{var}_index = (lin // {stride}) % {shape[dim]}")
            lines.append(f"{var} = {opdef.triton([f'{var}_index'], node.attrs)}")
        elif node.op == "rand_uniform":
            lines.append(f"{var} = {opdef.triton(['lin'], node.attrs)}")
        else:
            assert opdef.triton is not None, node.op
            lines.append(f"{var} = {opdef.triton([names[i.id] for i in node.inputs], node.attrs)}")
        names[node.id] = var
    lines.append(f"tl.store(out_ptr + lin, {names[graph.outputs[0].id]}, mask=lin < n)")
    body = "lin = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n" + "\n".join(lines)
    return body, params


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_decomposed_dropout_runs_as_triton_bit_exact(p: float) -> None:
    pytest.importorskip("triton")
    import triton

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1")
    x = rand(13, 31)
    g = fg.Graph(name="dropout")
    h = g.tensor_like(x)
    # dropout plus an iota term, so that both generators go through their hooks
    g.add(g.dropout(h, p, seed=99, offset=5), g.iota((13, 31), 1, "float32")).set_output()
    graph = decompose(g.to_ir())
    body, params = _pointwise_kernel_source(graph)
    kernel = _load_kernel(body, ", ".join([*params, "out_ptr", "n"]))
    out = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128)
    expected = fg.reference(g)(x)
    assert torch.equal(out, expected)
    keep = uniform_np((13, 31), 99, 5) >= p
    assert torch.equal(expected, torch.where(keep, x * (1.0 / (1.0 - p)), 0.0) + torch.arange(31.0))
