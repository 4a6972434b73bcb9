"""The README's API example, end to end on CPU."""

import torch

import fusegraph as fg
from conftest import assert_close, rand


def test_readme_example_runs() -> None:
    M, N = 64, 96
    g = fg.Graph(name="block", compute_dtype="float32")
    x = g.tensor((M, N), dtype="bfloat16", name="x")
    r_t = rand(M, N, dtype=torch.bfloat16)
    r = g.tensor_like(r_t, name="r")
    w = g.tensor((N,), dtype="bfloat16", name="w")
    b = g.tensor((N,), dtype="bfloat16", name="b")
    h = g.add(x, r)
    y = g.layernorm(h, weight=w, bias=b, eps=1e-5)
    h.set_output()
    y.set_output()
    g.validate()
    plan = g.build()
    x_t, w_t, b_t = rand(M, N, dtype=torch.bfloat16), rand(N, dtype=torch.bfloat16), rand(N, dtype=torch.bfloat16)
    outs = plan.execute({x: x_t, r: r_t, w: w_t, b: b_t})
    h_t, y_t = plan(x_t, r_t, w_t, b_t)
    ref = torch.nn.functional.layer_norm((x_t + r_t).float(), (N,), w_t.float(), b_t.float())
    assert_close(y_t, ref, what="layernorm")
    assert torch.equal(outs[y], y_t)
    assert torch.equal(h_t, x_t + r_t)
    ref_outs = fg.reference(g).execute({x: x_t, r: r_t, w: w_t, b: b_t})
    assert_close(ref_outs[y], ref, what="reference")
