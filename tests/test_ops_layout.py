"""Layout and indexing ops: op table against independent torch (floats and ints, non-contiguous
inputs), view properties and costs, what the code generator needs in `extra`, typed errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.ir.registry import LAYOUT_TRANSPARENT, VIEW, get_op
from optable import FLOAT_DTYPES, OpCase, const, make, params, run_case, seeded

WITH_INT = (*FLOAT_DTYPES, torch.int32)
_GATHER_INDEX = torch.randint(0, 5, (3, 4, 2), generator=seeded(1))
_EMBED_INDEX = torch.randint(0, 10, (3, 4), dtype=torch.int32, generator=seeded(2))
_SELECT_INDEX = torch.tensor([4, 0, 4, 2, 1])
_GATHER_INDEX_I32 = torch.randint(0, 5, (2, 3), dtype=torch.int32, generator=seeded(3))

LAYOUT = [
    OpCase("reshape_minus1", [make(4, 6, 5)], lambda g, x: g.reshape(x, (2, -1, 5)),
           lambda x: x.reshape(2, 12, 5), WITH_INT),
    OpCase("reshape_noncontig_flat", [make(4, 6, transpose=(0, 1))], lambda g, x: g.reshape(x, -1),
           lambda x: x.reshape(-1), WITH_INT),
    OpCase("reshape_to_scalar_dims", [make(1, 1)], lambda g, x: g.reshape(x, ()), lambda x: x.reshape(())),
    OpCase("permute", [make(2, 3, 4)], lambda g, x: g.permute(x, (2, 0, 1)), lambda x: x.permute(2, 0, 1),
           WITH_INT),
    OpCase("permute_negative_noncontig", [make(3, 5, 7, step=2)], lambda g, x: g.permute(x, -1, 0, 1),
           lambda x: x.permute(2, 0, 1)),
    OpCase("transpose", [make(3, 5, 7, transpose=(0, 2))], lambda g, x: g.transpose(x, -2, -1),
           lambda x: x.transpose(1, 2), WITH_INT),
    OpCase("expand", [make(3, 1, 5)], lambda g, x: g.expand(x, (2, 3, 4, -1)), lambda x: x.expand(2, 3, 4, 5),
           WITH_INT),
    OpCase("slice_neg_clamped_step", [make(4, 11)], lambda g, x: g.slice(x, 1, -9, 100, 2),
           lambda x: x[:, 2::2], WITH_INT),
    OpCase("slice_defaults_noncontig", [make(6, 4, transpose=(0, 1))], lambda g, x: g.slice(x, 0, end=-1),
           lambda x: x[:-1]),
    OpCase("slice_empty", [make(4, 5)], lambda g, x: g.slice(x, -1, 4, 2), lambda x: x[:, 4:2]),
    OpCase("concat3", [make(2, 3, 4), make(2, 1, 4, transpose=(0, 1)), make(2, 5, 4, step=3)],
           lambda g, a, b, c: g.concat([a, b, c], dim=1), lambda a, b, c: torch.cat([a, b, c], 1), WITH_INT),
    OpCase("cat_last_dim", [make(3, 2), make(3, 7)], lambda g, a, b: g.cat((a, b), -1),
           lambda a, b: torch.cat([a, b], -1)),
    OpCase("pad_last", [make(3, 5)], lambda g, x: g.pad(x, (1, 2)), lambda x: F.pad(x, (1, 2)), WITH_INT),
    OpCase("pad_two_dims_value", [make(2, 3, 5, transpose=(1, 2))], lambda g, x: g.pad(x, (1, 0, 2, 3), value=2.5),
           lambda x: F.pad(x, (1, 0, 2, 3), value=2.5)),
    OpCase("pad_negative_crops", [make(4, 6)], lambda g, x: g.pad(x, (-1, 2, 0, -2)),
           lambda x: F.pad(x, (-1, 2, 0, -2))),
    OpCase("gather", [make(4, 5, 3), const(_GATHER_INDEX)], lambda g, x, i: g.gather(x, 1, i),
           lambda x, i: torch.gather(x, 1, i), WITH_INT),
    OpCase("gather_noncontig_int32_index", [make(5, 6, transpose=(0, 1)), const(_GATHER_INDEX_I32)],
           lambda g, x, i: g.gather(x, 0, i), lambda x, i: torch.gather(x, 0, i.long())),
    OpCase("embedding", [const(_EMBED_INDEX), make(10, 6)], lambda g, i, w: g.embedding(i, w),
           lambda i, w: w[i.long()]),
    OpCase("index_select", [make(5, 3, 2), const(_SELECT_INDEX)], lambda g, x, i: g.index_select(x, 0, i),
           lambda x, i: x[i], WITH_INT),
    OpCase("to_layout_nhwc", [make(2, 3, 4, 5)], lambda g, x: g.to_layout(x, "NHWC"),
           lambda x: x.contiguous(memory_format=torch.channels_last), WITH_INT),
    OpCase("to_layout_contiguous", [make(2, 3, 4, transpose=(0, 2))], lambda g, x: g.to_layout(x, "contiguous"),
           lambda x: x.contiguous()),
    OpCase("index_select_dim_noncontig", [make(3, 7, transpose=(0, 1)), const(torch.tensor([6, 6, 0]))],
           lambda g, x, i: g.index_select(x, -1, i), lambda x, i: x[:, i]),
]


@pytest.mark.parametrize(("case", "dtype"), params(LAYOUT))
def test_layout_table(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


# ---------------------------------------------------------------- properties, costs, extra

def _cost(handle: fg.Tensor) -> tuple[int, int]:
    node = handle.node
    cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
    return cost.bytes, cost.flops


def test_views_are_free_and_describe_their_index_map() -> None:
    g = fg.Graph()
    x = g.tensor((4, 6, 5), "bfloat16")
    views = {
        "reshape": (g.reshape(x, 24, -1), {"shape": (24, 5)}),
        "permute": (g.permute(x, 2, 0, 1), {"perm": (2, 0, 1)}),
        "transpose": (g.transpose(x, 0, -1), {"perm": (2, 1, 0)}),
        "expand": (g.expand(g.reshape(x, 4, 1, 30), 3, 4, 2, -1), {"shape": (3, 4, 2, 30)}),
        "slice": (g.slice(x, -2, -5, None, 2), {"dim": 1, "start": 1, "length": 3, "step": 2}),
    }
    for op, (handle, want) in views.items():
        opdef = get_op(op)
        assert opdef.has(VIEW), op
        assert _cost(handle) == (0, 0), op
        node = handle.node
        assert opdef.extra["view_params"](node.inputs[0].spec, node.attrs) == want, op
        assert callable(opdef.extra["fold"]), op
    assert views["slice"][0].shape == (4, 3, 5)
    assert get_op("slice").has(LAYOUT_TRANSPARENT) and not get_op("reshape").has(LAYOUT_TRANSPARENT)


def test_data_movement_costs() -> None:
    g = fg.Graph()
    a, b = g.tensor((2, 3), "float16"), g.tensor((2, 5), "float16")
    assert _cost(g.concat([a, b], 1)) == (2 * (6 + 10 + 16), 0)
    assert _cost(g.pad(a, (1, 1))) == (2 * (6 + 10), 0)
    table, ids = g.tensor((1000, 8)), g.tensor((3,), "int64")
    # only the 3 selected rows of the table are read
    assert _cost(g.embedding(ids, table)) == (3 * 8 * 4 + 3 * 8 + 3 * 8 * 4, 0)
    small, idx = g.tensor((2, 4)), g.tensor((5,), "int32")
    assert _cost(g.index_select(small, 1, idx)) == (2 * 4 * 4 + 5 * 4 + 2 * 5 * 4, 0)


def test_layout_transparent_ops_keep_channels_last() -> None:
    g = fg.Graph()
    x = g.tensor((2, 8, 5, 5), layout="NHWC")
    assert g.slice(x, 1, 0, 4).spec.layout == "NHWC"
    assert g.concat([x, x], 1).spec.layout == "NHWC"
    assert g.pad(x, (1, 1, 1, 1)).spec.layout == "NHWC"
    assert g.permute(x, 0, 2, 3, 1).spec.layout is None


# ---------------------------------------------------------------- typed errors

def test_layout_errors() -> None:
    g = fg.Graph()
    x = g.tensor((3, 4, 5), name="x")
    with pytest.raises(fg.ShapeError, match=r"op reshape.*\(3, 4, 5\).*60 elements into shape \(7, 9\)"):
        g.reshape(x, 7, 9)
    with pytest.raises(fg.ShapeError, match=r"op reshape.*60 elements into shape \(7, -1\)"):
        g.reshape(x, 7, -1)
    with pytest.raises(fg.ShapeError, match=r"op reshape.*at most one -1"):
        g.reshape(x, -1, -1)
    with pytest.raises(fg.ShapeError, match=r"op transpose.*dim 3 is out of range.*rank 3"):
        g.transpose(x, 0, 3)
    with pytest.raises(fg.ShapeError, match=r"op permute.*\(0, 0, 1\) are not a permutation"):
        g.permute(x, 0, 0, 1)
    with pytest.raises(fg.ShapeError, match=r"op slice.*dim -4 is out of range"):
        g.slice(x, -4, 0, 1)
    with pytest.raises(fg.ShapeError, match=r"op slice.*step must be >= 1, got 0"):
        g.slice(x, 0, 0, 2, 0)
    with pytest.raises(fg.ShapeError, match=r"op expand.*dim 1 has size 4, which is neither 1 nor 6"):
        g.expand(x, 3, 6, 5)
    with pytest.raises(fg.ShapeError, match=r"op concat.*tensor 1 has shape \(3, 2, 4\).*\(3, 4, 5\).*dim 1"):
        g.concat([x, g.tensor((3, 2, 4))], dim=1)
    with pytest.raises(fg.ShapeError, match=r"op concat.*dim 3 is out of range"):
        g.concat([x, x], dim=3)
    with pytest.raises(fg.ShapeError, match=r"op pad.*pairs for at most 3 dims"):
        g.pad(x, (1, 2, 3))
    with pytest.raises(fg.ShapeError, match=r"op pad.*makes dim 2.*negative \(-1\)"):
        g.pad(x, (-3, -3))
    with pytest.raises(fg.UnsupportedError, match=r"mode 'reflect'"):
        g.pad(x, (1, 1), mode="reflect")


def test_index_errors() -> None:
    g = fg.Graph()
    x = g.tensor((4, 5), name="x")
    float_index = g.tensor((4, 2), "float32", name="fi")
    with pytest.raises(fg.DTypeError, match=r"op gather.*index must be an integer tensor, got float32"):
        g.gather(x, 1, float_index)
    with pytest.raises(fg.ShapeError, match=r"op gather.*\(5, 2\) is larger than input \(4, 5\) in dim 0"):
        g.gather(x, 1, g.tensor((5, 2), "int64"))
    with pytest.raises(fg.ShapeError, match=r"op gather.*dim 2 is out of range"):
        g.gather(x, 2, g.tensor((4, 2), "int64"))
    with pytest.raises(fg.DTypeError, match=r"op embedding.*indices must be an integer tensor, got bfloat16"):
        g.embedding(g.tensor((3,), "bfloat16"), x)
    with pytest.raises(fg.ShapeError, match=r"op embedding.*weight must be 2-D.*\(4, 5, 1\)"):
        g.embedding(g.tensor((3,), "int64"), g.tensor((4, 5, 1)))
    with pytest.raises(fg.DTypeError, match=r"op index_select.*got float16"):
        g.index_select(x, 0, g.tensor((3,), "float16"))
    with pytest.raises(fg.ShapeError, match=r"op index_select.*0-D or 1-D, got shape \(3, 1\)"):
        g.index_select(x, 0, g.tensor((3, 1), "int64"))


def test_out_of_range_index_values_fail_at_execute_naming_the_node() -> None:
    g = fg.Graph()
    w, ids = g.tensor((4, 3)), g.tensor((2,), "int64")
    g.embedding(ids, w, name="lookup").set_output()
    with pytest.raises(fg.ExecutionError, match=r"node 'lookup' \(op embedding\)"):
        fg.reference(g)(torch.randn(4, 3), torch.tensor([1, 9]))


# ---------------------------------------------------------------- folding views into strided reads

def _torch_view(t: torch.Tensor, op: str, args: tuple) -> torch.Tensor:  # type: ignore[type-arg]
    if op == "reshape":
        return t.view(*args)          # raises when the reshape is not a strided view
    if op == "slice":
        dim, start, end, step = args
        index = [slice(None)] * t.dim()
        index[dim] = slice(start, end, step)
        return t[tuple(index)]
    return getattr(t, op)(*args)


# (input shape, strides, offset, [(op, args), ...], whether the last step needs a copy)
_CHAINS = [
    ((4, 6, 5), (30, 5, 1), 0, [("reshape", (2, 2, 30)), ("permute", (2, 0, 1)), ("slice", (0, 3, None, 4)),
                                ("reshape", (-1,))], True),
    ((4, 6, 5), (1, 4, 24), 0, [("transpose", (0, 2)), ("reshape", (30, 4)), ("slice", (0, -7, -1, 3)),
                                ("reshape", (2, 2, 2))], False),
    ((4, 6, 5), (1, 4, 24), 0, [("transpose", (0, 2)), ("reshape", (30, 4)), ("slice", (0, -7, -1, 3)),
                                ("reshape", (8,))], True),
    ((4, 6, 3), (60, 10, 2), 7, [("reshape", (24, 1, 3)), ("expand", (2, 24, 5, 3)), ("transpose", (0, 3)),
                                 ("slice", (2, 1, 4, 1)), ("reshape", (3, 24, 6))], False),
    ((1, 5), (5, 1), 3, [("expand", (3, 4, 5)), ("reshape", (12, 5))], False),
    ((1, 5), (5, 1), 3, [("expand", (3, 4, 5)), ("transpose", (1, 2)), ("reshape", (15, 4))], True),
    ((1, 5), (5, 1), 3, [("expand", (3, 4, 5)), ("slice", (1, 1, 3, 1)), ("reshape", (3, 1, 2, 5))], False),
    ((2, 3, 4), (12, 4, 1), 0, [("slice", (-1, 1, 3, 1)), ("reshape", (6, 2)), ("reshape", (12,))], True),
    ((2, 3, 4), (1, 2, 6), 5, [("permute", (2, 1, 0)), ("reshape", (24,)), ("reshape", (4, 1, 6))], False),
]


@pytest.mark.parametrize(("shape", "strides", "offset", "steps", "copies_at_end"), _CHAINS)
def test_view_fold_matches_torch_strided_views(shape, strides, offset, steps, copies_at_end) -> None:  # type: ignore[no-untyped-def]
    base = torch.arange(2000, dtype=torch.float32)
    t = base.as_strided(shape, strides, offset)
    g = fg.Graph()
    h = g.tensor(shape)
    cur: tuple | None = (tuple(strides), offset)  # type: ignore[type-arg]
    for k, (op, args) in enumerate(steps):
        in_spec = h.spec
        h = getattr(g, op)(h, *args)
        assert cur is not None
        cur = get_op(op).extra["fold"](in_spec, h.node.attrs, *cur)
        if cur is None:  # the fold says "copy needed": torch must agree
            assert copies_at_end and k == len(steps) - 1, f"unexpected copy at {op}{args}"
            with pytest.raises(RuntimeError, match="view size is not compatible"):
                _torch_view(t, op, args)
            return
        t = _torch_view(t, op, args)
        assert tuple(t.shape) == h.shape
        assert torch.equal(base.as_strided(h.shape, cur[0], cur[1]), t), f"{op}{args}"
    assert not copies_at_end, "the fold found a strided view where a copy was expected"
