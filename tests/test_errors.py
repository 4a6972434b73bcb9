"""Bad input: every misuse is a typed error naming the node, its op, the offending values and the
user's source line (checked by line number)."""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fusegraph as fg
from conftest import rand
from fusegraph.errors import InvalidValueError


def next_line() -> int:
    """The line number after the caller's line: write `line = next_line()` above the bad call."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def at(line: int) -> str:
    """The regex of the user-line part of a message."""
    return rf"test_errors\.py:{line}\b"


@contextlib.contextmanager
def raises(error: type[Exception], *parts: str, call_line: bool = True) -> Iterator[None]:
    """pytest.raises(error) whose message matches `parts` in order and, when `call_line`, names the
    line of this file that made the failing call (the user's line)."""
    with pytest.raises(error, match=".*".join(parts)) as info:
        yield
    frames = [entry for entry in info.traceback if entry.path == Path(__file__)]
    if call_line:
        line = frames[-1].lineno + 1   # pytest counts lines from 0
        assert re.search(at(line), str(info.value)), f"line {line} not in: {info.value}"


def raises_in_execute(*parts: str) -> contextlib.AbstractContextManager[None]:
    """ExecutionError naming the input's (or node's) declaration line, not the execute call."""
    return raises(fg.ExecutionError, *parts, call_line=False)


def two_input_graph() -> tuple[fg.Graph, fg.Tensor, fg.Tensor, fg.Tensor, int, int]:
    g = fg.Graph("feeds")
    line_x = next_line()
    x = g.tensor((4, 8), name="x")
    line_y = next_line()
    y = g.tensor((8,), name="y")
    out = g.add(x, y, name="out")
    out.set_output()
    return g, x, y, out, line_x, line_y


def test_every_error_is_a_fusegraph_error() -> None:
    for cls in (fg.GraphError, fg.ShapeError, fg.DTypeError, fg.UnsupportedError, fg.ExecutionError):
        assert issubclass(cls, fg.FusegraphError)


# ---------------------------------------------------------------- building the graph
def test_non_broadcastable_shapes() -> None:
    g = fg.Graph("shapes")
    x, y = g.tensor((4, 8), name="x"), g.tensor((5, 8), name="y")
    with raises(fg.ShapeError, r"node 'add_\d+' \(op add\)",
                re.escape("shapes (4, 8), (5, 8) are not broadcastable (dim -2: sizes [4, 5])")):
        g.add(x, y)


def test_named_node_and_axis_out_of_range() -> None:
    g = fg.Graph("axes")
    x = g.tensor((4, 8), name="x")
    with raises(fg.ShapeError, r"node 'total' \(op sum\)", "dim 5 is out of range for a tensor of rank 2"):
        g.sum(x, 5, name="total")


def test_wrong_dtypes() -> None:
    g = fg.Graph("dtypes")
    x = g.tensor((4,), name="x")
    b = g.tensor((4,), dtype="bool", name="b")
    with raises(fg.DTypeError, r"\(op logical_and\)", "logical ops take bool tensors, got float32"):
        g.logical_and(b, x)
    h = g.tensor((4, 4), dtype="float16", name="h")
    w = g.tensor((4, 4), dtype="float32", name="w")
    with raises(fg.DTypeError, r"\(op matmul\)", "float16 and float32"):
        g.matmul(h, w)
    with raises(fg.DTypeError, r"\(op where\)", "condition must be bool, got float32"):
        g.where(x, x, x)


def test_tensor_from_another_graph() -> None:
    g1, g2 = fg.Graph("first"), fg.Graph("second")
    decl = next_line()
    x = g1.tensor((4,), name="x")
    with raises(fg.GraphError, r"node 'mul_\d+' \(op mul\)", "tensor 'x' \\(op input, created at ",
                at(decl), "belongs to graph 'first', not to graph 'second'"):
        g2.mul(x, 2.0)
    with raises(fg.GraphError, r"set_output", "belongs to graph 'first'"):
        g2.set_output(x)


def test_torch_tensors_and_other_objects_as_operands() -> None:
    g = fg.Graph("operands")
    x = g.tensor((4,), name="x")
    with raises(fg.GraphError, r"\(op add\)", r"got a torch.Tensor \(4,\) torch.float32",
                "tensor_like"):
        g.add(x, torch.ones(4))
    with raises(fg.GraphError, r"\(op add\)", "unsupported operand of type str: 'one'"):
        g.add(x, "one")


def test_set_output_takes_tensors() -> None:
    g = fg.Graph("outputs")
    with raises(fg.GraphError, "set_output", "got int: 3"):
        g.set_output(3)


def test_no_outputs() -> None:
    g = fg.Graph("empty")
    g.exp(g.tensor((4,), name="x"))
    with raises(fg.GraphError, "graph empty has no outputs", "set_output"):
        g.validate()
    with raises(fg.GraphError, "has no outputs"):
        g.build()


def test_duplicate_names() -> None:
    g = fg.Graph("names")
    g.tensor((4,), name="x")
    with raises(fg.GraphError, r"node 'x' \(op input\)", "the name 'x' is already used in graph names"):
        g.tensor((4,), name="x")
    y = g.tensor((4,), name="y")
    with raises(fg.GraphError, r"node 'y' \(op exp\)", "already used"):
        g.exp(y, name="y")
    with raises(fg.GraphError, r"\(op constant\)", "already used"):
        g.constant(torch.ones(2), name="y")


def test_automatic_names_never_collide_with_user_names() -> None:
    g = fg.Graph("auto")
    a = g.tensor((4,), name="in1")       # the automatic name of the next input
    b = g.tensor((4,))
    c = g.exp(a, name="exp_2")
    d = g.exp(b)
    names = [t.name for t in (a, b, c, d)]
    assert len(set(names)) == 4


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"shape": (4, -1)}, fg.ShapeError, r"shape \(4, -1\) must be a sequence of non-negative ints"),
    ({"shape": (4, 2.5)}, fg.ShapeError, "non-negative ints"),
    ({"shape": "abc"}, fg.ShapeError, "non-negative ints"),
    ({"shape": (4,), "dtype": "complex7"}, fg.DTypeError, "unknown dtype 'complex7'"),
    ({"shape": (4, 8), "layout": "NHWC"}, fg.ShapeError, r"layout 'NHWC' does not fit shape \(4, 8\)"),
    ({"shape": (4, 8), "strides": (1,)}, fg.ShapeError, r"strides \(1,\) do not match shape \(4, 8\)"),
    ({"shape": (4,), "device": "nowhere"}, fg.GraphError, "device 'nowhere' is not a device"),
])
def test_bad_input_declarations(kwargs: dict, error: type[Exception], message: str) -> None:
    g = fg.Graph("decl")
    with raises(error, r"node 'bad' \(op input\)", message):
        g.tensor(name="bad", **kwargs)


def test_bad_constants_and_tensor_like() -> None:
    g = fg.Graph("consts")
    with raises(fg.GraphError, r"\(op constant\)", "got list"):
        g.constant([1.0, 2.0])
    with raises(fg.DTypeError, r"\(op constant\)", "complex64"):
        g.constant(torch.ones(2, dtype=torch.complex64))
    with raises(fg.GraphError, r"\(op input\)", "tensor_like takes a torch.Tensor, got ndarray"):
        g.tensor_like(torch.ones(2).numpy())


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_non_finite_or_non_positive_scales(scale: float) -> None:
    g = fg.Graph("quant")
    x = g.tensor((4, 8), name="x")
    with raises(InvalidValueError, r"node 'q' \(op quantize\)", f"scale must be a finite number > 0, got {scale}"):
        g.quantize(x, "float8_e4m3fn", scale=scale, name="q")
    bad = g.constant(torch.tensor([1.0, scale]), name="bad_scale")
    with raises(InvalidValueError, "op dequantize", "constant scale 'bad_scale' must be finite and > 0"):
        g.dequantize(g.cast(x, "int8"), bad, granularity="row")
    assert issubclass(InvalidValueError, fg.FusegraphError)


# ---------------------------------------------------------------- executing
def test_missing_feeds_name_the_input_and_its_line() -> None:
    g, x, _, _, _, line_y = two_input_graph()
    plan = g.build(device="cpu")
    with raises_in_execute(r"missing feeds for: node 'y' \(op input\)", at(line_y)):
        plan.execute({x: rand(4, 8)})
    with raises_in_execute("missing feeds", "'y'"):
        fg.reference(g).execute({"x": rand(4, 8)})


def test_extra_feeds() -> None:
    g, x, y, out, _, _ = two_input_graph()
    other = fg.Graph("other")
    line = next_line()
    z = other.tensor((8,), name="z")
    plan = g.build(device="cpu")
    feeds = {x: rand(4, 8), y: rand(8)}
    with raises_in_execute(r"node 'z' \(op input\)", at(line), r"not an input of this graph \(inputs: x, y\)"):
        plan.execute({**feeds, z: rand(8)})
    with raises_in_execute(r"node 'out' \(op add\)", "not an input"):
        plan.execute({**feeds, out: rand(4, 8)})
    with raises_in_execute("feed 'w': not an input"):
        plan.execute({**feeds, "w": rand(8)})
    with raises_in_execute(r"node 'x' \(op input\)", "fed twice"):
        plan.execute({**feeds, "x": rand(4, 8)})
    with raises_in_execute("execute takes a dict", r"plan\(\*tensors\)"):
        plan.execute([rand(4, 8), rand(8)])


def test_feeds_of_the_wrong_shape() -> None:
    g, _, _, _, line_x, _ = two_input_graph()
    static = g.build(device="cpu", static=True)
    with raises_in_execute(r"node 'x' \(op input\)", at(line_x), r"expected shape \(4, 8\), got \(4, 9\)"):
        static(rand(4, 9), rand(8))
    with raises_in_execute(r"node 'x' \(op input\)", at(line_x), r"expected shape \(4, 8\), got \(4, 9\)"):
        fg.reference(g)(rand(4, 9), rand(8))
    # a plan that may rebuild for new shapes still rejects shapes the graph cannot take
    plan = g.build(device="cpu")
    with raises_in_execute(r"node 'out' \(op add\)", "cannot be rebuilt", "not broadcastable"):
        plan(rand(4, 9), rand(8))


def test_feeds_of_the_wrong_dtype() -> None:
    g, x, y, _, line_x, _ = two_input_graph()
    static = g.build(device="cpu", static=True)
    with raises_in_execute(r"node 'x' \(op input\)", at(line_x), "expected dtype float32, got float16"):
        static.execute({x: rand(4, 8, dtype=torch.float16), y: rand(8)})
    with raises_in_execute(r"node 'x' \(op input\)", "expected dtype float32, got int32"):
        fg.reference(g)(torch.zeros(4, 8, dtype=torch.int32), rand(8))


def test_feeds_on_the_wrong_device() -> None:
    g, _, _, _, line_x, _ = two_input_graph()
    other = "cpu" if torch.cuda.is_available() else "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # no GPU here: kernels fall back, which warns
        plan = g.build(device=other)
    on = "cuda" if other == "cpu" else "cpu"
    feeds = [rand(4, 8, device=on), rand(8, device=on)]
    with raises_in_execute(r"node 'x' \(op input\)", at(line_x), f"expected a tensor on {other}, got one on {on}"):
        plan(*feeds)


def test_wrong_number_of_positional_tensors() -> None:
    g, *_ = two_input_graph()
    plan = g.build(device="cpu")
    with raises_in_execute(r"expected 2 input tensors in declaration order \(x, y\), got 1"):
        plan(rand(4, 8))
    with raises_in_execute("expected 2 input tensors", "got 3"):
        plan(rand(4, 8), rand(8), rand(8))
    with raises_in_execute("expected 2 input tensors", "got 1"):
        fg.reference(g)(rand(4, 8))


def test_non_tensor_feeds() -> None:
    g, x, y, _, line_x, _ = two_input_graph()
    plan = g.build(device="cpu")
    with raises_in_execute(r"node 'x' \(op input\)", at(line_x), r"expected a torch.Tensor, got list: \[1.0"):
        plan([1.0] * 8, rand(8))
    with raises_in_execute(r"node 'y' \(op input\)", "expected a torch.Tensor, got float"):
        plan.execute({x: rand(4, 8), y: 2.0})
