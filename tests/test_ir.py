"""The IR: the verifier on broken graphs, cycles, the printer, provenance."""

from __future__ import annotations

import inspect

import pytest
import torch

import fusegraph as fg
from fusegraph.ir import Attrs, Graph, Node, TensorSpec
from fusegraph.ir.registry import all_ops, define
from fusegraph.ir.verify import verify
from fusegraph.passes import optimize


def line_here() -> int:
    """The line number of the caller (to check the user's line in messages)."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def split2_op() -> str:
    """A test-only multi-output op: (x + 1, x * 2)."""
    name = "test_split2"
    if name not in all_ops():
        define(name, lambda specs, a: (specs[0], specs[0]), lambda xs, a: (xs[0] + 1, xs[0] * 2),
               doc="test-only two-output op")
    return name


def small_graph() -> tuple[fg.Graph, fg.Tensor, fg.Tensor]:
    g = fg.Graph("small")
    x = g.tensor((4, 8), name="x")
    y = g.exp(x, name="y")
    y.set_output()
    return g, x, y


# ---------------------------------------------------------------- verifier
def test_verify_accepts_a_built_graph() -> None:
    g, _, _ = small_graph()
    verify(g.to_ir())


def test_verify_no_outputs() -> None:
    g, _, _ = small_graph()
    ir = g.to_ir()
    with pytest.raises(fg.GraphError, match="has no outputs"):
        verify(Graph("empty", ir.inputs, ()))


def test_verify_duplicate_node_ids() -> None:
    g, x, y = small_graph()
    ir = g.to_ir()
    with pytest.raises(fg.GraphError, match=r"node 'y' \(op exp\).*appears twice"):
        verify(ir.with_(order=(x.node, y.node, y.node)))


def test_verify_graph_inputs_must_be_input_nodes() -> None:
    _, x, y = small_graph()
    with pytest.raises(fg.GraphError, match=r"node 'y' \(op exp\).*only 'input' nodes"):
        verify(Graph("bad", (x.node, y.node), (y.node,)))
    with pytest.raises(fg.GraphError, match="listed twice"):
        verify(Graph("bad", (x.node, x.node), (y.node,)))


def test_verify_foreign_input_node() -> None:
    g, _, y = small_graph()
    other = fg.Graph("other")
    z = other.tensor((4, 8), name="z")
    mixed = y.node.replace(op="add", inputs=(y.node, z.node))
    with pytest.raises(fg.GraphError, match=r"node 'z' \(op input\).*not an input of graph small"):
        verify(Graph("small", g.to_ir().inputs, (mixed,)))


def test_verify_not_in_topological_order() -> None:
    g, x, y = small_graph()
    with pytest.raises(fg.GraphError, match=r"node 'y' \(op exp\).*input 'x'.*not computed before it"):
        verify(g.to_ir().with_(order=(y.node, x.node)))


def test_verify_wrong_number_of_inputs_and_wrong_spec() -> None:
    _, x, y = small_graph()
    two = y.node.replace(inputs=(x.node, x.node))
    with pytest.raises(fg.GraphError, match=r"has 2 inputs; op exp takes 1..1"):
        verify(Graph("bad", (x.node,), (two,)))
    wrong = y.node.replace(specs=(TensorSpec((4, 8), "float16"),))
    with pytest.raises(fg.GraphError, match=r"recorded specs .*float16.* differ from inferred .*float32"):
        verify(Graph("bad", (x.node,), (wrong,)))
    rejected = y.node.replace(op="logical_not")
    with pytest.raises(fg.GraphError, match=r"op logical_not.*rules? rejects its inputs.*bool"):
        verify(Graph("bad", (x.node,), (rejected,)))


def test_verify_unknown_op_and_unfrozen_attrs() -> None:
    _, x, y = small_graph()
    with pytest.raises(fg.GraphError, match="unknown op 'no_such_op'"):
        verify(Graph("bad", (x.node,), (y.node.replace(op="no_such_op"),)))
    with pytest.raises(fg.GraphError, match="attrs are not frozen"):
        verify(Graph("bad", (x.node,), (y.node.replace(attrs={"a": 1}),)))


def test_verify_getitem_index_and_multi_output_use() -> None:
    op = split2_op()
    g = fg.Graph("multi")
    x = g.tensor((4,), name="x")
    first, second = g._apply(op, x, name="s")
    g.set_output(g.add(first, second))
    verify(g.to_ir())
    parent = first.node.inputs[0]
    bad_index = first.node.replace(attrs=Attrs(index=2))
    with pytest.raises(fg.GraphError, match=r"node 's.0' \(op getitem\).*index 2 is out of range for 's'"):
        verify(Graph("bad", (x.node,), (bad_index,)))
    direct = Node("exp", (parent,), Attrs(), (TensorSpec((4,), "float32"),), "e")
    with pytest.raises(fg.GraphError, match="has 2 outputs, directly"):
        verify(Graph("bad", (x.node,), (direct,)))
    with pytest.raises(fg.GraphError, match="multi-output node cannot be a graph output"):
        verify(Graph("bad", (x.node,), (parent,)))


def test_cycle_is_a_graph_error_naming_the_node_and_line() -> None:
    g = fg.Graph("cyclic")
    x = g.tensor((4,), name="x")
    a = g.exp(x, name="a")
    line = line_here() + 1
    b = g.neg(a, name="b")
    object.__setattr__(a.node, "inputs", (b.node,))   # nodes are frozen: break one by hand
    with pytest.raises(fg.GraphError) as info:
        Graph("cyclic", (x.node,), (b.node,))
    message = str(info.value)
    assert "node 'b' (op neg)" in message and "part of a cycle (b -> a -> b)" in message
    assert f"tests/test_ir.py:{line}" in message
    b.set_output()
    with pytest.raises(fg.GraphError, match="cycle"):
        g.validate()


# ---------------------------------------------------------------- printer and provenance
def test_printer_shows_types_sources_scalars_and_outputs() -> None:
    g = fg.Graph("printed")
    x = g.tensor((4, 8), dtype="bfloat16", name="x")
    line = line_here() + 1
    y = g.mul(x, 0.5, name="y")
    y.set_output()
    text = str(g.to_ir())
    assert "graph printed (compute float32, 3 nodes):" in text
    assert "inputs: x: bfloat16[4x8]" in text
    assert f"y: bfloat16[4x8] = mul(x, 0.5)  # tests/test_ir.py:{line}" in text
    assert "scalar" not in text            # scalars are written inline
    assert text.rstrip().endswith("outputs: y")


def test_printer_multi_output_and_constants() -> None:
    op = split2_op()
    g = fg.Graph("multi")
    x = g.tensor((3,), name="x")
    first, second = g._apply(op, x, name="s")
    small = g.constant(torch.tensor([1.0, 2.0, 3.0]), name="c")
    big = g.constant(torch.zeros(16, 16), name="big")
    g.set_output(g.add(first, small), g.add(second, g.sum(big)))
    text = str(g.to_ir())
    assert "s: (float32[3], float32[3]) = test_split2(x)" in text
    assert "s.0: float32[3] = s[0]" in text and "s.1: float32[3] = s[1]" in text
    assert "c: float32[3] = constant([1.0, 2.0, 3.0])" in text
    assert "big: float32[16x16] = constant(<float32[16x16] on cpu>)" in text


def test_provenance_records_each_pass_and_prints() -> None:
    g = fg.Graph("prov")
    x = g.tensor((4,), name="x")
    g.set_output(g.exp(g.mul(x, 1.0)))
    out = optimize(g.to_ir())
    names = [r.name for r in out.provenance]
    assert names[0] == "simplify" and {"fold", "cse", "dce"} <= set(names)
    assert all(r.seconds >= 0 for r in out.provenance)
    first = out.provenance[0]
    assert (first.nodes_before, first.nodes_after) == (4, 2)
    assert "# constructed by simplify (took " in str(out) and "4 -> 2 nodes" in str(out)


def test_plan_prints_its_launch_list() -> None:
    g, _, _ = small_graph()
    plan = g.build(device="cpu")
    text = str(plan)
    assert text.startswith("plan for small on cpu:") and "kernel" in text


def test_tensor_spec_and_attrs_basics() -> None:
    spec = TensorSpec((2, 3, 4, 5), "bf16", layout="NHWC")
    assert spec.dtype == "bfloat16" and spec.numel == 120 and spec.nbytes == 240
    assert spec.memory_strides == (60, 1, 15, 3)
    assert str(spec) == "bfloat16[2x3x4x5] NHWC"
    a = Attrs(dims=[0, 1], keepdim=True)
    assert a["dims"] == (0, 1) and hash(a) == hash(Attrs(keepdim=True, dims=(0, 1)))
    with pytest.raises(fg.DTypeError, match="unknown dtype 'complex7'"):
        TensorSpec((2,), "complex7")
