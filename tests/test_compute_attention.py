"""Attention: the flash-style Triton kernels (forward with lse, backward) against the reference
under the interpreter (fp16), causal / additive / boolean masks / GQA, through build(); the
unfused pattern rewritten to one attention op; what no Triton kernel covers runs elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.codegen.attention import AttentionProblem, attention_backward, attention_configs, attention_forward
from fusegraph.ops.attention import _sdpa_bwd_math, _sdpa_math
from fusegraph.passes.attention_match import attention_match

F16 = torch.float16
CASES = [  # B, H, Hk, Sq, Sk, D, causal, mask kind (0 none, 1 additive, 2 bool)
    (1, 2, 2, 20, 20, 16, False, 0),
    (2, 4, 2, 33, 17, 32, True, 0),
    (1, 2, 1, 24, 40, 16, False, 1),
    (1, 2, 2, 24, 40, 16, False, 2),
    (1, 2, 2, 40, 24, 16, True, 0),
]


def _inputs(b: int, h: int, hk: int, sq: int, sk: int, d: int, kind: int) -> list[torch.Tensor]:
    q = torch.randn(b, h, sq, d, dtype=F16)
    k, v = torch.randn(b, hk, sk, d, dtype=F16), torch.randn(b, hk, sk, d, dtype=F16)
    if kind == 1:
        return [q, k, v, torch.randn(1, 1, sq, sk, dtype=F16)]
    if kind == 2:
        mask = torch.rand(b, 1, sq, sk) > 0.3
        mask[0, 0, 3] = False  # a query row that sees no key: out 0, lse -inf
        return [q, k, v, mask]
    return [q, k, v]


@pytest.mark.parametrize("tiles", ["default", "16x16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_attention_forward_and_backward_match_reference(case: tuple, tiles: str) -> None:
    b, h, hk, sq, sk, d, causal, kind = case
    xs = _inputs(b, h, hk, sq, sk, d, kind)
    mask = xs[3] if kind else None
    p = AttentionProblem(b, h, hk, sq, sk, d, d, causal, kind, 1 / math.sqrt(d), F16)
    # 16x16 tiles: several key blocks per row, so the unmasked interior loop runs too
    config = attention_configs(p)[0] if tiles == "default" else {"BLOCK_M": 16, "BLOCK_N": 16}
    out, lse = attention_forward(*xs[:3], mask, p, config)
    attrs = {"is_causal": causal, "has_mask": kind != 0, "return_lse": True, "enable_gqa": True}
    ref_out, ref_lse = _sdpa_math(xs, attrs)
    assert_close(out, ref_out, what="out")
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], tol=1e-5, what="lse")
    grad = torch.randn_like(out)
    got = attention_backward(grad, *xs[:3], out, lse, mask, p, {} if tiles == "default" else
                             {"BWD_BLOCK_M": 16, "BWD_BLOCK_N": 16})
    want = _sdpa_bwd_math([grad, *xs[:3], out] + ([mask] if kind else []), attrs)
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g_.shape == w_.shape
        assert_close(g_, w_.to(F16), what=name)


def test_attention_graph_forward_with_lse_and_backward_through_build() -> None:
    g = fg.Graph(name="sdpa", compute_dtype="float32")
    q = g.tensor((1, 4, 24, 32), dtype="float16", name="q")
    k = g.tensor((1, 2, 24, 32), dtype="float16", name="k")
    v = g.tensor((1, 2, 24, 32), dtype="float16", name="v")
    do = g.tensor((1, 4, 24, 32), dtype="float16", name="do")
    out, lse = g.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    dq, dk, dv = g.sdpa_backward(do, q, k, v, out, lse, is_causal=True, enable_gqa=True)
    for t in (out, dq, dk, dv):
        t.set_output()
    plan = g.build(device="cpu")
    kinds = [(k_.kind, k_.backend) for k_ in plan.kernels if k_.kind == "attention"]
    assert kinds == [("attention", "triton"), ("attention", "triton")]
    xs = {q: torch.randn(1, 4, 24, 32, dtype=F16), k: torch.randn(1, 2, 24, 32, dtype=F16),
          v: torch.randn(1, 2, 24, 32, dtype=F16), do: torch.randn(1, 4, 24, 32, dtype=F16)}
    got, ref = plan.execute(xs), fg.reference(g).execute(xs)
    for t in (out, dq, dk, dv):
        assert_close(got[t], ref[t], what=t.name)


def test_fp32_attention_goes_to_the_reference_with_a_reason() -> None:
    g = fg.Graph(name="fp32")
    q = g.tensor((1, 1, 8, 24), dtype="float32", name="q")
    y = g.scaled_dot_product_attention(q, q, q)
    y.set_output()
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    assert kernel.backend == "reference" and "float32" in kernel.note
    x = torch.randn(1, 1, 8, 24)
    assert_close(plan(x), torch.nn.functional.scaled_dot_product_attention(x, x, x))


def _unfused(variant: str) -> tuple[fg.Graph, list, object]:
    g = fg.Graph(name="attn", compute_dtype="float32")
    q = g.tensor((1, 2, 24, 16), dtype="float16", name="q")
    k = g.tensor((1, 2, 40, 16), dtype="float16", name="k")
    v = g.tensor((1, 2, 40, 16), dtype="float16", name="v")
    m = g.tensor((1, 1, 24, 40), dtype="float16", name="m")
    if variant == "scale_q":
        s = g.matmul(g.mul(q, 0.25), g.transpose(k, -2, -1))
    else:
        s = g.matmul(q, g.transpose(k, -2, -1))
        s = g.div(s, math.sqrt(16)) if variant == "div_sqrt" else g.mul(s, 0.25)
    if variant == "mask":
        s = g.add(s, m)
    y = g.matmul(g.softmax(s, -1), v)
    y.set_output()
    return g, [q, k, v, m], y


@pytest.mark.parametrize("variant", ["mul_after", "div_sqrt", "scale_q", "mask"])
def test_unfused_attention_becomes_one_attention_op(variant: str) -> None:
    g, ins, y = _unfused(variant)
    plan = g.build(device="cpu")
    assert [(k.kind, k.ops) for k in plan.kernels] == [("attention", ["scaled_dot_product_attention"])]
    node = plan.kernels[0].nodes[0]
    assert node.attrs["scale"] == pytest.approx(0.25) and node.attrs["has_mask"] == (variant == "mask")
    xs = [torch.randn(*t.shape, dtype=F16) for t in ins]
    got = plan.execute(dict(zip(ins, xs, strict=True)))[y]
    ref = fg.reference(g).execute(dict(zip(ins, xs, strict=True)))[y]
    assert_close(got, ref, what=variant)


def test_attention_match_leaves_probabilities_that_are_used_elsewhere() -> None:
    g = fg.Graph(name="keep")
    q = g.tensor((1, 2, 8, 16), dtype="float16", name="q")
    probs = g.softmax(g.mul(g.matmul(q, q, transpose_b=True), 0.25), -1)
    y = g.matmul(probs, q)
    y.set_output()
    probs.set_output()
    rewritten = attention_match(g.to_ir())
    assert "scaled_dot_product_attention" not in [n.op for n in rewritten.nodes]
    assert "softmax" in [n.op for n in rewritten.nodes]


def test_torch_sdpa_candidate_gives_zero_rows_where_a_bool_mask_hides_every_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import fusegraph.backends.attention_kernel as ak
    import fusegraph.backends.cudnn as cudnn

    def math_sdpa(q, k, v, mask, causal, scale, backend):  # type: ignore[no-untyped-def]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    monkeypatch.setattr(cudnn, "torch_sdpa", math_sdpa)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.rand(1, 1, 4, 6) > 0.5
    mask[0, 0, 1] = False
    p = AttentionProblem(1, 2, 2, 4, 6, 8, 8, False, 2, 0.35, torch.float32)
    (out,) = ak._torch_forward(None, p, "math")([q, k, v, mask])  # type: ignore[arg-type]
    ref = _sdpa_math([q, k, v, mask], {"has_mask": True, "scale": 0.35})
    assert torch.isfinite(out).all()
    assert_close(out, ref, tol=1e-5)


class _RecordingKernel:
    """Stands in for a jitted attention kernel: records what Triton would be asked to compile."""

    def __init__(self, name: str, seen: list[tuple[str, dict]]) -> None:
        self.name, self.seen = name, seen

    def warmup(self, *args: object, grid: tuple[int, ...], **consts: object) -> str:
        assert all(isinstance(a, torch.Tensor | int | float) for a in args)
        self.seen.append((self.name, dict(consts)))
        return self.name


@pytest.mark.parametrize("with_lse", [True, False])
def test_attention_kernels_compile_ahead_once_per_distinct_launch(monkeypatch: pytest.MonkeyPatch,
                                                                   with_lse: bool) -> None:
    """precompile's jobs for an attention node, one warmup each: one per forward config; the backward's
    configs differ only in forward options its kernels do not read, so with the forward's lse two jobs
    (dk/dv, dq), without it three per config (the forward it recomputes, dk/dv, dq). None when
    launch-bound."""
    from fusegraph.backends import attention_kernel
    from fusegraph.codegen import attention as codegen_attention
    from fusegraph.tune import autotuner

    seen: list[tuple[str, dict]] = []
    monkeypatch.setattr(codegen_attention, "_kernel", lambda name: _RecordingKernel(name, seen))
    monkeypatch.setattr(attention_kernel, "_random_inputs",
                        lambda node, device: [torch.randn(n.shape).to(fg.ir.dtypes.to_torch(n.dtype))
                                              for n in node.inputs])
    g = fg.Graph(name="attn_jobs")
    q, k, v = (g.tensor((2, 4, 256, 64), dtype="float16", name=n) for n in "qkv")
    out, lse = g.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    dy = g.tensor((2, 4, 256, 64), dtype="float16", name="dy")
    grads = g.sdpa_backward(dy, q, k, v, out, lse=lse if with_lse else None, is_causal=True)
    for t in (out, lse, *grads):
        t.set_output()
    nodes = {n.op: n for n in g.to_ir().nodes}
    monkeypatch.setattr(autotuner, "launch_bound", lambda floor: False)
    forward = attention_kernel.attention_warmup_jobs(nodes["scaled_dot_product_attention"], "cuda")
    assert len(forward) == len(attention_configs(attention_kernel.attention_problem(
        nodes["scaled_dot_product_attention"])))
    assert [job() for job in forward] == ["attention_fwd"] * len(forward)     # each returns its handle
    assert [name for name, _ in seen] == ["attention_fwd"] * len(forward)
    assert len({repr(sorted(c.items())) for _, c in seen}) == len(forward)
    seen.clear()
    backward = attention_kernel.attention_warmup_jobs(nodes["sdpa_backward"], "cuda")
    for job in backward:
        job()
    if with_lse:
        assert len(backward) == 2 and [n for n, _ in seen] == ["attention_bwd_dkdv", "attention_bwd_dq"]
    else:
        assert len(backward) == 3 * len(forward)
        assert [n for n, _ in seen[:3]] == ["attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"]
    monkeypatch.setattr(autotuner, "launch_bound", lambda floor: True)
    assert attention_kernel.attention_warmup_jobs(nodes["sdpa_backward"], "cuda") == []
    assert attention_kernel.attention_warmup_jobs(nodes["sdpa_backward"], "cpu") == []


DECODE_CASES = [  # B, H, Hk, Sq, Sk, D, causal, mask kind
    (1, 8, 2, 1, 300, 32, False, 0),    # GQA, one query: the decode step
    (2, 4, 4, 2, 130, 16, False, 1),    # two queries (speculative), additive mask, no GQA
    (1, 4, 1, 4, 77, 16, False, 2),     # bool mask with a row that sees no key (row 3: out 0, lse -inf)
    (1, 2, 2, 4, 40, 16, True, 0),      # causal (top-left): query i sees keys 0..i
]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_split_kv_decode_kernels_match_reference(case: tuple) -> None:
    """codegen/attention.py's split-KV kernels (a program per kv head x chunk of keys, its GQA group's
    query rows together, partials merged in chunk order) against the reference: out and lse, with
    several chunks (the split count is forced up) and a chunk cut short by the end of the keys."""
    from fusegraph.codegen.attention import decode_config

    b, h, hk, sq, sk, d, causal, kind = case
    xs = _inputs(b, h, hk, sq, sk, d, kind)
    mask = xs[3] if kind else None
    p = AttentionProblem(b, h, hk, sq, sk, d, d, causal, kind, 1 / math.sqrt(d), F16)
    config = decode_config(p)
    assert config is not None and config["VARIANT"] == "decode"
    assert (config["SPLITS"] > 1) == (sk > config["BLOCK_N"])
    assert (config["SPLITS"] - 1) * config["CHUNK"] < sk <= config["SPLITS"] * config["CHUNK"]
    for cfg in (config, dict(config, CHUNK=48 if sk > 48 else 16, SPLITS=-(-sk // (48 if sk > 48 else 16)),
                             BLOCK_N=16)):
        out, lse = attention_forward(*xs[:3], mask, p, cfg)
        attrs = {"is_causal": causal, "has_mask": kind != 0, "return_lse": True, "enable_gqa": True}
        ref_out, ref_lse = _sdpa_math(xs, attrs)
        assert_close(out, ref_out, what=f"decode out {cfg}")
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert_close(lse[fin], ref_lse[fin], tol=1e-5, what="decode lse")
    if kind == 2:
        assert torch.all(out[0, :, 3] == 0)


def test_decode_config_only_for_few_rows_per_kv_head() -> None:
    """The split-KV kernels take GQA group x Sq <= DECODE_MAX_ROWS rows; the splits fill the GPU."""
    from fusegraph.codegen.attention import DECODE_MAX_ROWS, decode_config

    step = AttentionProblem(1, 32, 8, 1, 2048, 128, 128, False, 1, 0.1, torch.bfloat16)
    cfg = decode_config(step)
    assert cfg is not None and cfg["BLOCK_M"] == 16 and 128 <= cfg["SPLITS"] * 8 <= 2 * 132   # ~1 per SM
    assert cfg["SPLITS"] * cfg["CHUNK"] >= 2048 and cfg["CHUNK"] % cfg["BLOCK_N"] == 0
    prefill = AttentionProblem(1, 32, 8, DECODE_MAX_ROWS, 2048, 128, 128, True, 0, 0.1, torch.bfloat16)
    assert decode_config(prefill) is None
    big_batch = AttentionProblem(64, 32, 8, 1, 2048, 128, 128, False, 0, 0.1, torch.bfloat16)
    assert decode_config(big_batch)["SPLITS"] == 1


def test_decode_attention_through_build_takes_the_split_kv_kernels() -> None:
    """A one-query GQA attention with an additive mask (a decode step) has the split-KV candidate,
    listed first (what the interpreter runs; on a GPU the tuner or the launch-bound rule picks), and
    it matches the reference."""
    g = fg.Graph(name="decode", compute_dtype="float32")
    q = g.tensor((1, 8, 1, 32), dtype="float16", name="q")
    k = g.tensor((1, 2, 200, 32), dtype="float16", name="k")
    v = g.tensor((1, 2, 200, 32), dtype="float16", name="v")
    m = g.tensor((1, 1, 1, 200), dtype="float16", name="m")
    out = g.scaled_dot_product_attention(q, k, v, m, enable_gqa=True)
    out.set_output()
    plan = g.build(device="cpu")
    (kernel,) = [k_ for k_ in plan.kernels if k_.kind == "attention"]
    assert (kernel.backend, kernel.config["candidate"]) == ("triton", "triton:decode")
    assert "attention_decode_partial" in kernel.source and "attention_decode_merge" in kernel.source
    xs = {q: torch.randn(1, 8, 1, 32, dtype=F16), k: torch.randn(1, 2, 200, 32, dtype=F16),
          v: torch.randn(1, 2, 200, 32, dtype=F16), m: torch.randn(1, 1, 1, 200, dtype=F16)}
    assert_close(plan.execute(xs)[out], fg.reference(g).execute(xs)[out], what="decode attention")
