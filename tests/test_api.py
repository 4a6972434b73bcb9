"""The Graph API contract: handles, feeds, outputs, constants, names, and what execute leaves alone."""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.settings import override


def mlp_graph() -> tuple[fg.Graph, dict[str, fg.Tensor]]:
    g = fg.Graph("api", compute_dtype="float32")
    x = g.tensor((4, 8), dtype="bfloat16", name="x")
    w = g.tensor((8,), dtype="bfloat16", name="w")
    b = g.tensor((8,), name="b")
    h = g.add(g.mul(x, w), 0.5, name="h")
    y = g.sum(g.cast(g.relu(h), "float32") * b, -1, name="y")
    h.set_output()
    y.set_output()
    return g, {"x": x, "w": w, "b": b, "h": h, "y": y}


def mlp_feeds() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rand(4, 8, dtype=torch.bfloat16), rand(8, dtype=torch.bfloat16), rand(8)


def eager(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each op rounds, as the plans built with round_intermediates do (the fp32 y checks them exactly)."""
    h = ((x.float() * w.float()).to(torch.bfloat16).float() + 0.5).to(torch.bfloat16)
    return h, (torch.relu(h.float()) * b).sum(-1)


def test_execute_with_handle_keys_returns_outputs_keyed_by_handle() -> None:
    g, t = mlp_graph()
    x_t, w_t, b_t = mlp_feeds()
    with override(round_intermediates=True):
        plan = g.build(device="cpu")
    outs = plan.execute({t["x"]: x_t, t["w"]: w_t, t["b"]: b_t})
    assert list(outs) == [t["h"], t["y"]]                      # set_output order
    h_ref, y_ref = eager(x_t, w_t, b_t)
    assert outs[t["h"]].dtype == torch.bfloat16 and outs[t["y"]].dtype == torch.float32
    assert_close(outs[t["h"]], h_ref, what="h")
    assert_close(outs[t["y"]], y_ref, what="y")
    by_name = plan.execute({"x": x_t, "w": w_t, "b": b_t})     # input names work as keys too
    assert torch.equal(by_name[t["y"]], outs[t["y"]])
    ref = fg.reference(g).execute({t["x"]: x_t, t["w"]: w_t, t["b"]: b_t})
    assert list(ref) == [t["h"], t["y"]]
    assert_close(ref[t["y"]], y_ref, what="reference")


def test_call_takes_inputs_in_declaration_order_and_returns_outputs_in_set_output_order() -> None:
    g, _ = mlp_graph()
    assert [h.name for h in g.inputs()] == ["x", "w", "b"]
    assert [h.name for h in g.output_handles()] == ["h", "y"]
    x_t, w_t, b_t = mlp_feeds()
    with override(round_intermediates=True):
        plan = g.build(device="cpu")
    h_t, y_t = plan(x_t, w_t, b_t)
    h_ref, y_ref = eager(x_t, w_t, b_t)
    assert_close(h_t, h_ref, what="h")
    assert_close(y_t, y_ref, what="y")
    h_r, y_r = fg.reference(g)(x_t, w_t, b_t)
    assert torch.equal(h_r, h_t)
    assert_close(y_r, y_ref, what="reference y")


def test_a_single_output_is_returned_as_a_tensor() -> None:
    g = fg.Graph("single")
    x = g.tensor((3,), name="x")
    g.exp(x).set_output()
    x_t = rand(3)
    out = g.build(device="cpu")(x_t)
    assert isinstance(out, torch.Tensor)
    assert_close(out, x_t.exp())
    assert isinstance(fg.reference(g)(x_t), torch.Tensor)


def test_set_output_twice_counts_once_and_keeps_order() -> None:
    g = fg.Graph("order")
    x = g.tensor((3,), name="x")
    a, b = g.exp(x), g.neg(x)
    b.set_output()
    a.set_output()
    g.set_output(b)
    assert [h.name for h in g.output_handles()] == [b.name, a.name]
    b_t, a_t = g.build(device="cpu")(x_t := rand(3))
    assert torch.equal(b_t, -x_t)
    assert_close(a_t, x_t.exp())


def test_execute_does_not_mutate_user_inputs() -> None:
    g, t = mlp_graph()
    feeds = mlp_feeds()
    saved = [f.clone() for f in feeds]
    plan = g.build(device="cpu")
    for _ in range(2):
        plan.execute(dict(zip((t["x"], t["w"], t["b"]), feeds, strict=True)))
        plan(*feeds)
        fg.reference(g)(*feeds)
    for f, s in zip(feeds, saved, strict=True):
        assert torch.equal(f, s)


def test_an_output_that_is_an_input_is_not_the_users_tensor() -> None:
    g = fg.Graph("alias")
    x = g.tensor((3,), name="x")
    g.mul(x, 1.0).set_output()                          # simplifies to x itself
    x_t = rand(3)
    saved = x_t.clone()
    plan = g.build(device="cpu")
    for out in (plan(x_t), fg.reference(plan.graph)(x_t)):
        assert torch.equal(out, saved)
        out.add_(1.0)                                   # writing into the result ...
        assert torch.equal(x_t, saved), "the output aliases the user's input"


def test_constants_are_copied_when_declared() -> None:
    g = fg.Graph("consts")
    x = g.tensor((3,), name="x")
    scale = torch.tensor([1.0, 2.0, 3.0])
    c = g.constant(scale, name="scale")
    g.mul(x, c).set_output()
    scale.mul_(100)                                     # changing it later does not change the graph
    x_t = rand(3)
    assert_close(g.build(device="cpu")(x_t), x_t * torch.tensor([1.0, 2.0, 3.0]))
    k = g.constant(2.5, name="k")
    assert k.name == "k" and k.shape == () and k.dtype == "float32"


def test_tensor_like_takes_shape_dtype_device_and_layout() -> None:
    g = fg.Graph("like")
    t = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    h = g.tensor_like(t, name="img")
    assert h.shape == (2, 3, 4, 5) and h.dtype == "float32" and h.spec.layout == "NHWC"
    assert h.spec.device == "cpu"
    v = g.tensor_like(torch.zeros(7, dtype=torch.float16))
    assert v.dtype == "float16" and v.spec.layout is None


def test_python_operators_and_weak_typed_numbers() -> None:
    g = fg.Graph("ops")
    x = g.tensor((4,), dtype="bfloat16", name="x")
    y = (2.0 * x + 1) / 4 - x
    z = -y
    assert y.dtype == "bfloat16" and z.shape == (4,)
    i = g.tensor((4,), dtype="int32", name="i")
    assert (i * 3).dtype == "int32" and (i * 0.5).dtype == "float32"
    z.set_output()
    x_t = rand(4, dtype=torch.bfloat16)
    assert_close(fg.reference(g)(x_t, torch.zeros(4, dtype=torch.int32)), -((2.0 * x_t + 1) / 4 - x_t))


def test_validate_returns_the_graph_and_str_prints_it() -> None:
    g, _ = mlp_graph()
    assert g.validate() is g
    text = str(g)
    assert text.startswith("graph api (compute float32") and "h: bfloat16[4x8]" in text
    assert str(fg.Graph("new")) == "graph new (no outputs yet)"


def test_the_plan_runs_the_optimized_graph() -> None:
    g = fg.Graph("optimized")
    x = g.tensor((4,), name="x")
    y = g.mul(g.neg(g.neg(x)), g.add(g.constant(1.0), g.constant(1.0)))
    y.set_output()
    plan = g.build(device="cpu")
    ops = [n.op for n in plan.graph.nodes if n.op not in ("input", "scalar")]
    assert ops == ["mul"]
    passes = [r.name for r in plan.graph.provenance]
    assert [p for p in passes if p in ("simplify", "fold", "cse", "dce")][:4] == ["simplify", "fold", "cse", "dce"]
    x_t = rand(4)
    assert_close(plan(x_t), x_t * 2)


def test_pow_and_matmul_operators() -> None:
    g = fg.Graph("more_ops")
    a, b = g.tensor((3, 4), name="a"), g.tensor((4, 5), name="b")
    y = (a @ b) ** 2
    z = 2.0 ** a
    assert y.shape == (3, 5) and z.shape == (3, 4)
    g.set_output(y, z)
    a_t, b_t = rand(3, 4), rand(4, 5)
    y_t, z_t = fg.reference(g)(a_t, b_t)
    assert_close(y_t, (a_t @ b_t) ** 2)
    assert_close(z_t, 2.0 ** a_t)


def test_a_tensor_has_no_truth_value() -> None:
    g = fg.Graph("truth")
    x = g.tensor((3,), name="x")
    with pytest.raises(fg.GraphError, match=r"node 'x' \(op input\).*neither true nor false.*g.where"):
        if x:
            pass


def test_shapes_may_be_numpy_ints_or_a_torch_size() -> None:
    import numpy as np

    g = fg.Graph("shapes")
    assert g.tensor((np.int64(2), 3), name="a").shape == (2, 3)
    assert g.tensor(torch.Size([4, 5]), name="b").shape == (4, 5)
    assert g.tensor(7, name="c").shape == (7,)


def test_outputs_merged_by_cse_are_still_distinct_tensors() -> None:
    g = fg.Graph("dupes")
    x = g.tensor((3,), name="x")
    a, b = g.exp(x), g.exp(x)                  # equal: CSE merges them
    g.set_output(a, b)
    plan = g.build(device="cpu")
    assert sum(n.op == "exp" for n in plan.graph.nodes) == 1
    for a_t, b_t in (plan(rand(3)), fg.reference(plan.graph)(rand(3))):
        assert torch.equal(a_t, b_t) and a_t.data_ptr() != b_t.data_ptr()
