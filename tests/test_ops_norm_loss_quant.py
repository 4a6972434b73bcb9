"""Normalizations (forward and backward), losses, dropout, iota and quantization: one op table.

Every case builds a graph through fg.Graph and runs it twice, with the reference executor and
with its decomposition into primitives (passes.decompose + reference.execute_graph); both are
compared to an independent float64 torch computation (autograd for the backward ops), over
float32 / float16 / bfloat16 inputs, odd sizes, broadcasting and non-contiguous inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.ir import dtypes as fg_dtypes
from fusegraph.ir.registry import COMPOSITE, get_op
from fusegraph.passes.decompose import decompose
from fusegraph.reference import execute_graph
from optable import Maker, OpCase, const, make, params

PRIMITIVES = {"input", "scalar", "constant", "getitem", "cast", "iota", "rand_uniform", "reshape", "sum", "max",
              "min", "abs", "neg", "exp", "log", "rsqrt", "sqrt", "floor", "add", "sub", "mul", "div", "maximum",
              "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_not", "where"}


def run_both(case: OpCase, dtype: torch.dtype) -> None:
    """The reference executor and the decomposed graph, each against the independent expectation."""
    torch.manual_seed(sum(map(ord, case.id)))
    tensors = [m(dtype) for m in case.makers]
    g = fg.Graph(name=case.id)
    handles = [g.tensor_like(t, name=f"in{k}") for k, t in enumerate(tensors)]
    built = case.build(g, *handles)
    outs = built if isinstance(built, tuple) else (built,)
    g.set_output(*outs)
    g.validate()
    reference = fg.reference(g).execute(dict(zip(handles, tensors, strict=True)))
    decomposed = decompose(g.to_ir())
    leftover = {n.op for n in decomposed.nodes} - PRIMITIVES
    assert not leftover, f"{case.id}: decomposition left non-primitive ops {leftover}"
    assert not any(get_op(n.op).has(COMPOSITE) for n in decomposed.nodes)
    from_decomposition = execute_graph(decomposed, tensors)
    expected = case.expect(*(t.double() if t.is_floating_point() else t for t in tensors))
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(expected) == len(outs)
    for k, (o, want) in enumerate(zip(outs, expected, strict=True)):
        for how, got in (("reference", reference[o]), ("decomposition", from_decomposition[k])):
            what = f"{case.id} output {k} via {how} ({dtype})"
            assert got.dtype == fg_dtypes.to_torch(o.dtype), f"{what}: dtype {got.dtype} != {o.dtype}"
            assert tuple(got.shape) == o.shape, f"{what}: shape {tuple(got.shape)} != {o.shape}"
            if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
                assert_close(got.double(), want.double(), tol=case.tol.get(got.dtype, 1e-2), what=what)
            elif got.is_floating_point():
                assert_close(got, want, tol=case.tol.get(got.dtype), what=what)
            else:
                assert torch.equal(got, want.to(got.dtype)), f"{what}: values differ"


def positive(*shape: int, low: float = 0.5) -> Maker:
    """Random values >= low (running variances, scales)."""
    return lambda dtype: rand(*shape, dtype=dtype, low=low)


def scalar_value() -> Maker:
    """A random 0-d value (a loss's gradient)."""
    return lambda dtype: rand(1, dtype=dtype).reshape(())


# ---------------------------------------------------------------- independent expectations

def _layer_norm64(x, w, b, k, eps=1e-5):  # type: ignore[no-untyped-def]
    dims = tuple(range(x.dim() - k, x.dim()))
    y = (x - x.mean(dims, keepdim=True)) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
    return y * w + b if w is not None else y


def _rms_norm64(x, w, eps):  # type: ignore[no-untyped-def]
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def _per_channel(v, x):  # type: ignore[no-untyped-def]
    return v.reshape((-1,) + (1,) * (x.dim() - 2))


def _batch_norm_train64(x, w, b, eps=1e-5):  # type: ignore[no-untyped-def]
    dims = [0, *range(2, x.dim())]
    mean, var = x.mean(dims), x.var(dims, unbiased=False)
    y = (x - _per_channel(mean, x)) / torch.sqrt(_per_channel(var, x) + eps)
    n = x.numel() // x.shape[1]
    return y * _per_channel(w, x) + _per_channel(b, x), mean, var * n / (n - 1)


def _batch_norm_eval64(x, rm, rv, w=None, b=None, eps=1e-5):  # type: ignore[no-untyped-def]
    y = (x - _per_channel(rm, x)) / torch.sqrt(_per_channel(rv, x) + eps)
    return y * _per_channel(w, x) + _per_channel(b, x) if w is not None else y


def _group_norm64(x, groups, w, b, eps=1e-5):  # type: ignore[no-untyped-def]
    xg = x.reshape(x.shape[0], groups, -1)
    y = ((xg - xg.mean(-1, keepdim=True)) / torch.sqrt(xg.var(-1, unbiased=False, keepdim=True) + eps))
    y = y.reshape(x.shape)
    return y * _per_channel(w, x) + _per_channel(b, x) if w is not None else y


def _autograd(fn, grad_out, *inputs):  # type: ignore[no-untyped-def]
    """Gradients of fn(*inputs) (float64 leaves) given grad_out."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    fn(*leaves).backward(grad_out)
    return tuple(t.grad for t in leaves)


def _cross_entropy64(x, t, reduction="mean", ignore_index=-100, ls=0.0):  # type: ignore[no-untyped-def]
    valid = t != ignore_index
    safe = torch.where(valid, t, 0)
    lse = torch.logsumexp(x, dim=1)
    x_t = x.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = lse - (1 - ls) * x_t - ls * x.mean(dim=1)
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def _targets(n: int, classes: int, ignore: int | None = None, *extra: int) -> torch.Tensor:
    t = torch.randint(0, classes, (n, *extra), generator=torch.Generator().manual_seed(n * classes))
    if ignore is not None:
        t.view(-1)[::3] = ignore
    return t


# numpy implementation of rand_uniform's documented hash (independent of the op's torch code)
def _fmix32_np(h):  # type: ignore[no-untyped-def]
    import numpy as np
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def uniform_np(shape: tuple[int, ...], seed: int, offset: int = 0) -> torch.Tensor:
    import numpy as np
    with np.errstate(over="ignore"):
        key = _fmix32_np(np.array([(seed * 0x9E3779B9 + 0x632BE5AB) & 0xFFFFFFFF], dtype=np.uint32))[0]
        i = (np.arange(int(np.prod(shape)), dtype=np.uint64) + offset).astype(np.uint32)
        h = _fmix32_np((i * np.uint32(0x9E3779B1)) ^ key)
    return torch.from_numpy((h >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)).reshape(shape)


def _dropout64(x, p, seed, offset=0):  # type: ignore[no-untyped-def]
    keep = uniform_np(tuple(x.shape), seed, offset) >= p
    return torch.where(keep, x / (1 - p), 0.0)


QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def _quantize64(x, qdtype, granularity="tensor", block=128, scale=None):  # type: ignore[no-untyped-def]
    """Symmetric quantization written out directly (float32 division, as the op specifies)."""
    x32 = x.float()
    if granularity == "block":
        xb = x32.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    else:
        xb = x32
    if scale is None:
        if granularity == "tensor":
            amax = xb.abs().max()
        else:
            amax = xb.abs().amax(-1, keepdim=granularity == "row")
        scale = torch.clamp(amax, min=1e-12) / QMAX[qdtype]
    s = scale.float().unsqueeze(-1) if granularity == "block" else torch.as_tensor(scale).float()
    v = torch.clamp(xb / s, -QMAX[qdtype] - (qdtype == torch.int8), QMAX[qdtype])
    q = (torch.round(v) if qdtype == torch.int8 else v).to(qdtype).reshape(x.shape)
    return q, torch.as_tensor(scale).float()


# ---------------------------------------------------------------- the table

def _bn_train(g, x, w, b):  # type: ignore[no-untyped-def]
    return g.batch_norm(x, None, None, w, b, training=True)


NORMS = [
    OpCase("layer_norm_alias_2d", [make(9, 33), make(33), make(33)],
           lambda g, x, w, b: g.layer_norm(x, (33,), w, b), lambda x, w, b: _layer_norm64(x, w, b, 1)),
    OpCase("layer_norm_2dims_noncontig", [make(3, 5, 7, transpose=(0, 1)), make(5, 7), make(5, 7)],
           lambda g, x, w, b: g.layer_norm(x, (5, 7), w, b), lambda x, w, b: _layer_norm64(x, w, b, 2)),
    OpCase("rms_norm_alias", [make(6, 19), make(19)], lambda g, x, w: g.rms_norm(x, 19, w, eps=1e-6),
           lambda x, w: _rms_norm64(x, w, 1e-6)),
    OpCase("batch_norm_eval_4d", [make(3, 5, 4, 7), make(5), positive(5), make(5), make(5)],
           lambda g, x, rm, rv, w, b: g.batch_norm(x, rm, rv, w, b), _batch_norm_eval64),
    OpCase("batch_norm_eval_2d_noaffine", [make(11, 6), make(6), positive(6)],
           lambda g, x, rm, rv: g.batch_norm(x, rm, rv), _batch_norm_eval64),
    OpCase("batch_norm_train_4d", [make(4, 3, 5, 3), make(3), make(3)], _bn_train, _batch_norm_train64),
    OpCase("batch_norm_train_3d_noncontig", [make(5, 4, 7, transpose=(1, 2)), make(4), make(4)], _bn_train,
           _batch_norm_train64),
    OpCase("batch_norm_no_running_stats", [make(6, 3, 5), make(3), make(3)],
           lambda g, x, w, b: g.batch_norm(x, None, None, w, b, training=False),
           lambda x, w, b: _batch_norm_train64(x, w, b)[0]),
    OpCase("group_norm_4d", [make(2, 6, 5, 3), make(6), make(6)], lambda g, x, w, b: g.group_norm(x, 3, w, b),
           lambda x, w, b: _group_norm64(x, 3, w, b)),
    OpCase("group_norm_3d_noaffine_noncontig", [make(3, 8, 5, transpose=(0, 2))],
           lambda g, x: g.group_norm(x, 2), lambda x: _group_norm64(x, 2, None, None)),
]

NORM_BACKWARD = [
    OpCase("layernorm_backward", [make(7, 37), make(7, 37), make(37)],
           lambda g, dy, x, w: g.layernorm_backward(dy, x, 37, w),
           lambda dy, x, w: _autograd(lambda x_, w_, b_: F.layer_norm(x_, (37,), w_, b_), dy, x, w,
                                      torch.zeros_like(w))),
    OpCase("layernorm_backward_3d_noweight_noncontig", [make(2, 5, 13), make(2, 5, 13, transpose=(0, 1))],
           lambda g, dy, x: g.layernorm_backward(dy, x),
           lambda dy, x: _autograd(lambda x_, w_, b_: F.layer_norm(x_, (13,), w_, b_), dy, x,
                                   torch.ones(13, dtype=x.dtype), torch.zeros(13, dtype=x.dtype))),
    OpCase("rmsnorm_backward", [make(5, 3, 24), make(5, 3, 24), make(24)],
           lambda g, dy, x, w: g.rmsnorm_backward(dy, x, 24, w, eps=1e-6),
           lambda dy, x, w: _autograd(lambda x_, w_: _rms_norm64(x_, w_, 1e-6), dy, x, w)),
    OpCase("batchnorm_backward_4d", [make(3, 4, 5, 3), make(3, 4, 5, 3), make(4)],
           lambda g, dy, x, w: g.batchnorm_backward(dy, x, w),
           lambda dy, x, w: _autograd(lambda x_, w_, b_: F.batch_norm(x_, None, None, w_, b_, training=True),
                                      dy, x, w, torch.zeros_like(w))),
    OpCase("batchnorm_backward_2d_noweight", [make(9, 5), make(9, 5, transpose=(0, 1))],
           lambda g, dy, x: g.batchnorm_backward(dy, x),
           lambda dy, x: _autograd(lambda x_, w_, b_: F.batch_norm(x_, None, None, w_, b_, training=True),
                                   dy, x, torch.ones(5, dtype=x.dtype), torch.zeros(5, dtype=x.dtype))),
    OpCase("groupnorm_backward", [make(2, 6, 4, 3), make(2, 6, 4, 3), make(6)],
           lambda g, dy, x, w: g.groupnorm_backward(dy, x, 3, w),
           lambda dy, x, w: _autograd(lambda x_, w_, b_: F.group_norm(x_, 3, w_, b_), dy, x, w,
                                      torch.zeros_like(w))),
]

LOSSES = [
    OpCase("cross_entropy_mean", [make(13, 37), const(_targets(13, 37))],
           lambda g, x, t: g.cross_entropy(x, t), _cross_entropy64),
    OpCase("cross_entropy_sum_ignore_smooth", [make(11, 9), const(_targets(11, 9, ignore=-100))],
           lambda g, x, t: g.cross_entropy(x, t, reduction="sum", label_smoothing=0.2),
           lambda x, t: _cross_entropy64(x, t, "sum", ls=0.2)),
    OpCase("cross_entropy_none_custom_ignore_noncontig", [make(10, 7, transpose=(0, 1)),
                                                          const(_targets(10, 7, 3))],
           lambda g, x, t: g.cross_entropy(x, t, ignore_index=3, reduction="none"),
           lambda x, t: _cross_entropy64(x, t, "none", ignore_index=3)),
    OpCase("cross_entropy_spatial_int32", [make(3, 5, 4, 2), const(_targets(3, 5, -100, 4, 2).int())],
           lambda g, x, t: g.cross_entropy(x, t, label_smoothing=0.1),
           lambda x, t: _cross_entropy64(x.movedim(1, -1).reshape(-1, 5), t.reshape(-1).long(), ls=0.1)),
    OpCase("cross_entropy_backward_mean_ignore_smooth", [scalar_value(), make(12, 10), const(_targets(12, 10, -100))],
           lambda g, gr, x, t: g.cross_entropy_backward(gr, x, t, label_smoothing=0.1),
           lambda gr, x, t: _autograd(lambda x_: F.cross_entropy(x_, t, label_smoothing=0.1), gr, x)[0]),
    OpCase("cross_entropy_backward_none_broadcast_rows", [make(8), make(8, 21), const(_targets(8, 21, 0))],
           lambda g, gr, x, t: g.cross_entropy_backward(gr, x, t, reduction="none", ignore_index=0),
           lambda gr, x, t: _autograd(lambda x_: F.cross_entropy(x_, t, reduction="none", ignore_index=0), gr,
                                      x)[0]),
    OpCase("cross_entropy_backward_sum_spatial", [scalar_value(), make(2, 6, 5), const(_targets(2, 6, None, 5))],
           lambda g, gr, x, t: g.cross_entropy_backward(gr, x, t, reduction="sum"),
           lambda gr, x, t: _autograd(lambda x_: F.cross_entropy(x_, t, reduction="sum"), gr, x)[0]),
]

RANDOM_AND_INDEX = [
    OpCase("dropout_odd", [make(7, 33)], lambda g, x: g.dropout(x, 0.3, seed=11),
           lambda x: _dropout64(x, 0.3, 11)),
    OpCase("dropout_offset_noncontig", [make(5, 9, transpose=(0, 1))],
           lambda g, x: g.dropout(x, 0.5, seed=2**32 - 1, offset=1000), lambda x: _dropout64(x, 0.5, 2**32 - 1, 1000)),
    OpCase("dropout_p1_all_dropped", [make(4, 5)], lambda g, x: g.dropout(x, 1.0, seed=1),
           lambda x: torch.zeros_like(x)),
    OpCase("iota_plus_input_broadcast", [make(3, 4, 5)], lambda g, x: g.add(x, g.iota((4, 1), 0, "float32")),
           lambda x: x + torch.arange(4, dtype=x.dtype).reshape(4, 1)),
    OpCase("rand_uniform_scaled_input", [make(6, 7)], lambda g, x: g.mul(x, g.rand_uniform((6, 7), seed=9)),
           lambda x: x * uniform_np((6, 7), 9).double()),
]

QUANT = [
    OpCase(f"quantize_{q}_{gran}", [make(6, 64)],
           (lambda qd, gr: lambda g, x: g.quantize(x, qd, gr, block_size=16))(q, gran),
           (lambda qd, gr: lambda x: _quantize64(x, qd, gr, 16))(fg_dtypes.to_torch(q), gran))
    for q in ("int8", "float8_e4m3fn", "float8_e5m2") for gran in ("tensor", "row", "block")
] + [
    OpCase("quantize_int8_given_scale_number", [make(5, 7)], lambda g, x: g.quantize(x, "int8", scale=0.02),
           lambda x: _quantize64(x, torch.int8, scale=torch.tensor(0.02))),
    OpCase("quantize_fp8_given_row_scale_noncontig", [make(8, 6, transpose=(0, 1)), positive(8, 1, low=0.01)],
           lambda g, x, s: g.quantize(x, "float8_e4m3fn", "row", scale=s),
           lambda x, s: _quantize64(x, torch.float8_e4m3fn, "row", scale=s)),
    OpCase("dequantize_block_roundtrip", [make(3, 32)],
           lambda g, x: g.dequantize(*g.quantize(x, "int8", "block", block_size=8), dtype="float32",
                                     granularity="block", block_size=8),
           lambda x: _dequant_roundtrip(x, torch.int8, "block", 8), dtypes=(torch.float32,)),
    OpCase("dequantize_fp8_row_to_bf16", [make(4, 24)],
           lambda g, x: g.dequantize(*g.quantize(x, "float8_e5m2", "row"), dtype="bfloat16", granularity="row"),
           lambda x: _dequant_roundtrip(x, torch.float8_e5m2, "row", 128), dtypes=(torch.float32,)),
]


def _dequant_roundtrip(x, qdtype, gran, block):  # type: ignore[no-untyped-def]
    q, s = _quantize64(x, qdtype, gran, block)
    s = s.double().unsqueeze(-1).expand(*s.shape, block).reshape(x.shape) if gran == "block" else s.double()
    return q.double() * s


@pytest.mark.parametrize(("case", "dtype"), params(NORMS + NORM_BACKWARD + LOSSES + RANDOM_AND_INDEX + QUANT))
def test_op_table(case: OpCase, dtype: torch.dtype) -> None:
    run_both(case, dtype)
