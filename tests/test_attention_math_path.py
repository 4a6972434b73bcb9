"""Attention that reaches fusegraph as torch's math SDPA or as plain matmul/softmax code through
torch.compile (AOTAutograd spells each 4-D matmul view -> bmm -> view): passes/attention_match
rewrites it to one attention op, and simplify removes the all-true mask a traced Hugging Face
encoder builds (`arange(S)[:, None] >= 0`), so the [Sq, Sk] scores never reach memory.

Where it comes from: Hugging Face's ViTModel under torch.compile on the H200 (transformers 5.17)
built that mask, torch picked the math SDPA path for it (q, k, v upcast to fp32, a "safe" softmax),
and the compiled model ran at 6.0 ms against eager's 4.9 (eager skips the mask and runs flash)."""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.ir import Graph as IRGraph
from fusegraph.passes import simplify
from test_gqa_match import GQAAttention


class Encoder(nn.Module):
    """One attention block with separate q/k/v projections, as Hugging Face's encoders write it."""

    def __init__(self, mask: str, d: int = 32, heads: int = 2, explicit: bool = False, upcast: bool = False) -> None:
        super().__init__()
        self.heads, self.hd, self.mask, self.explicit, self.upcast = heads, d // heads, mask, explicit, upcast
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.mask == "arange":      # transformers' bidirectional mask: q_idx >= 0, all true
            mask = (torch.arange(s, device=x.device)[None, None, :, None] >= 0).expand(b, 1, s, s)
        elif self.mask == "given":
            mask = keep
        else:
            mask = None
        if self.explicit:              # the classic eager attention: matmul, scale, softmax, matmul
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.hd)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            probs = scores.float().softmax(-1).type_as(scores) if self.upcast else scores.softmax(-1)
            out = torch.matmul(probs, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


def _kernels(compiled: nn.Module) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in part.plan.kernels:
                kinds[k.kind] += 1
    return kinds


def _attention_nodes(compiled: nn.Module) -> list:
    return [k.nodes[0] for graph in compiled.fusegraph_report.graphs for part in graph.partitions
            for k in part.plan.kernels if k.kind == "attention"]


def _scores_sized(compiled: nn.Module, sq: int, sk: int) -> list[str]:
    """Plan buffers the size of a score matrix [.., Sq, Sk] (the attention op keeps them on chip)."""
    names = []
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in part.plan.kernels:
                for n in k.nodes:
                    if n.spec.rank >= 2 and tuple(n.shape[-2:]) == (sq, sk) and n.op != "scaled_dot_product_attention":
                        names.append(f"{k.kind}:{n.op}")
    return names


def _run_both(model: nn.Module, *inputs: torch.Tensor, math_path: bool = False) -> \
        tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """(eager output, compiled model, its output), inference; math_path: both on torch's math SDPA."""
    torch._dynamo.reset()
    with torch.no_grad(), (sdpa_kernel([SDPBackend.MATH]) if math_path else contextlib.nullcontext()):
        ref = model(*inputs)
        compiled = fg.compile(model)
        return ref, compiled, compiled(*inputs)


@pytest.mark.parametrize("mask", ["arange", "none"])
def test_math_sdpa_of_fp16_becomes_one_attention_op(mask: str) -> None:
    torch.manual_seed(0)
    seq = 80                                    # over fold's always-fold size: the iota is not a constant
    model = Encoder(mask).half().eval()
    x = rand(2, seq, 32, dtype=torch.float16)
    ref, compiled, out = _run_both(model, x, math_path=True)
    nodes = _attention_nodes(compiled)
    assert len(nodes) == 1, _kernels(compiled)
    attn = nodes[0]
    assert not attn.attrs["has_mask"]           # arange >= 0 is true everywhere: no mask left
    assert attn.dtype == "float16" and all(i.dtype == "float16" for i in attn.inputs[:3])   # no fp32 upcast
    assert attn.attrs["scale"] == pytest.approx(1 / math.sqrt(16))
    assert _scores_sized(compiled, seq, seq) == []
    assert_close(out, ref, what=f"math sdpa, mask={mask}")


def test_math_sdpa_with_a_real_mask_keeps_it_and_zeroes_fully_masked_rows() -> None:
    """A boolean mask from the caller stays (as its additive form); a query row with every key
    masked is 0 in torch's safe softmax and in our attention op alike."""
    torch.manual_seed(1)
    model = Encoder("given").half().eval()
    x = rand(2, 24, 32, dtype=torch.float16)
    keep = torch.rand(2, 1, 24, 24) > 0.3
    keep[:, :, 5, :] = False                   # query 5 sees no key
    ref, compiled, out = _run_both(model, x, keep, math_path=True)
    nodes = _attention_nodes(compiled)
    assert len(nodes) == 1 and nodes[0].attrs["has_mask"]
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert_close(out, ref, what="math sdpa with a boolean mask")


@pytest.mark.parametrize("dtype,upcast", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
def test_explicit_matmul_softmax_attention_through_torch_compile(dtype: torch.dtype, upcast: bool) -> None:
    """softmax(q @ k^T / sqrt(d)) @ v written out in a model: AOTAutograd's view -> bmm -> view
    spelling of the 4-D matmuls is seen through; so is T5's softmax(scores.float()).type_as(scores)."""
    torch.manual_seed(2)
    model = Encoder("none", explicit=True, upcast=upcast).to(dtype).eval()
    x = rand(2, 40, 32, dtype=dtype)
    ref, compiled, out = _run_both(model, x)
    assert len(_attention_nodes(compiled)) == 1, _kernels(compiled)
    assert _scores_sized(compiled, 40, 40) == []
    assert_close(out, ref, what=f"explicit attention {dtype}")


@pytest.mark.parametrize("form", ["masked_fill", "where_keep"])
def test_masked_fill_attention_becomes_a_boolean_mask(form: str) -> None:
    """scores.masked_fill(~keep, -inf) (nanoGPT's manual path) and where(keep, scores, -inf): the
    attention op takes `keep` as its boolean mask (negated back for masked_fill's form)."""
    class Filled(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            s = q @ k.transpose(-1, -2) * 0.25
            s = s.masked_fill(~keep, float("-inf")) if form == "masked_fill" else \
                torch.where(keep, s, torch.tensor(float("-inf")))
            return torch.softmax(s, dim=-1) @ v

    torch.manual_seed(4)
    q, k, v = (rand(2, 2, 24, 16, dtype=torch.float16) for _ in range(3))
    keep = torch.rand(2, 1, 24, 24) > 0.4
    keep[..., 0] = True                        # every query sees a key (eager's softmax is NaN otherwise)
    ref, compiled, out = _run_both(Filled(), q, k, v, keep)
    nodes = _attention_nodes(compiled)
    assert len(nodes) == 1 and nodes[0].attrs["has_mask"] and nodes[0].inputs[3].dtype == "bool"
    assert nodes[0].attrs["scale"] == pytest.approx(0.25)
    assert_close(out, ref, what=form)


def test_cross_attention_with_other_key_length_and_value_width() -> None:
    """Queries over 8 positions attend to 24 keys whose values are 12 wide: Sq, Sk and Dv all differ."""
    class Cross(nn.Module):       # the bias (a view of a 3-D tensor) is the add's first operand
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return torch.softmax(bias.view(1, 3, 8, 24) + torch.matmul(q, k.transpose(-1, -2)) * 0.3, dim=-1) @ v

    torch.manual_seed(5)
    q, k, v = rand(2, 3, 8, 16), rand(2, 3, 24, 16), rand(2, 3, 24, 12)
    bias = rand(3, 8, 24)
    ref, compiled, out = _run_both(Cross(), q, k, v, bias)
    nodes = _attention_nodes(compiled)
    assert len(nodes) == 1 and nodes[0].attrs["has_mask"], _kernels(compiled)
    assert [tuple(i.shape) for i in nodes[0].inputs] == [(2, 3, 8, 16), (2, 3, 24, 16), (2, 3, 24, 12), (1, 3, 8, 24)]
    assert nodes[0].attrs["scale"] == pytest.approx(0.3)
    assert_close(out, ref, what="cross attention")


def test_debug_output_names_each_rewritten_attention(capsys: pytest.CaptureFixture[str]) -> None:
    from fusegraph.passes.attention_match import attention_match
    from fusegraph.settings import override

    g = fg.Graph("unfused")
    q, k, v = (g.tensor((1, 2, 8, 16), name=n) for n in "qkv")
    g.matmul(g.softmax(g.mul(g.matmul(q, g.transpose(k, 2, 3)), 0.25), dim=-1), v).set_output()
    with override(debug=1):
        out = attention_match(g.to_ir())
    assert any(n.op == "scaled_dot_product_attention" for n in out.nodes)
    printed = capsys.readouterr().out
    assert "attention_match:" in printed and "q [1, 2, 8, 16] float32, scale 0.25, mask none" in printed, printed


def test_probabilities_used_elsewhere_are_not_rewritten() -> None:
    """Attention whose probabilities are also returned keeps its unfused form."""
    class Both(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            p = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
            return torch.matmul(p, v), p

    q, k, v = (rand(1, 2, 8, 16) for _ in range(3))
    torch._dynamo.reset()
    compiled = fg.compile(Both())
    out, p = compiled(q, k, v)
    ref_out, ref_p = Both()(q, k, v)
    assert _attention_nodes(compiled) == []
    assert_close(out, ref_out, what="out")
    assert_close(p, ref_p, what="p")


# ---------------------------------------------------------------- the simplify rules under it
def _ops(graph: IRGraph) -> Counter[str]:
    return Counter(n.op for n in graph.nodes if n.op != "input")


def test_comparisons_decided_by_an_iota_range() -> None:
    g = fg.Graph("ranges")
    x = g.tensor((6, 6), name="x")
    idx = g.iota((6, 1), dim=0)                                 # 0 .. 5
    always = g.ge(idx, 0)                                       # true everywhere
    never = g.lt(g.add(idx, 3), 3)                              # 3 .. 8 < 3: false everywhere
    open_ = g.ge(idx, 3)                                        # depends on the row: stays
    diff = g.le(g.sub(g.iota((6, 1), dim=0), g.iota((1, 6), dim=1)), 5)   # -5 .. 5 <= 5: true
    outs = [g.where(g.expand(c, 6, 6), x, g.neg(x)) for c in (always, never, open_, diff)]
    for o in outs:
        o.set_output()
    ir = g.to_ir()
    out = simplify(ir)
    assert out.outputs[0] is out.inputs[0]                      # where(true, x, -x) -> x
    assert out.outputs[1].op == "neg"                           # where(false, x, -x) -> -x
    assert out.outputs[2].op == "where" and out.outputs[2].inputs[0].op in ("expand", "ge")
    assert out.outputs[3] is out.inputs[0]
    feeds = [rand(6, 6)]
    for a, b in zip(fg.reference(out)(*feeds), fg.reference(ir)(*feeds), strict=True):
        assert torch.equal(a, b)


def test_nan_literal_and_float_rounding_decide_nothing() -> None:
    g = fg.Graph("undecided")
    idx = g.cast(g.iota((8,), dim=0), "float32")
    a = g.ge(idx, float("nan"))                                # false for every element, but not by bounds
    big = g.cast(g.iota((4,), dim=0), "float16")
    b = g.ge(g.add(big, 70000.0), 0)                           # overflows float16: not bounded
    wide = g.iota((8,), dim=0, dtype="int32")
    c = g.ge(g.add(wide, 2147483645), 0)                       # wraps past int32's max: not bounded
    half = g.iota((1, 4), dim=0, dtype="float16")              # all 0
    d = g.ge(g.add(half, 1000.0), 1000.2)                      # 1000.2 is 1000.0 in float16: true
    for t in (a, b, c, d):
        t.set_output()
    ir = g.to_ir()
    out = simplify(ir)
    assert [o.op for o in out.outputs] == ["ge", "ge", "ge", "ge"]
    assert bool(fg.reference(ir)()[3].all())
    assert not bool(fg.reference(ir)()[2].all())                # the wrapped element compares false


def test_add_of_a_broadcast_cast_zero_is_removed_only_at_the_result_shape() -> None:
    g = fg.Graph("zero_add")
    s = g.tensor((2, 2, 5, 5), name="s")
    small = g.tensor((5, 5), name="small")
    zero_mask = g.cast(g.expand(g.constant(torch.zeros(1, 1, 1, 1, dtype=torch.float16)), 2, 1, 5, 5), "float32")
    a = g.add(s, zero_mask)                                     # s
    b = g.add(small, zero_mask)                                 # broadcasts small up: stays
    for t in (a, b):
        t.set_output()
    ir = g.to_ir()
    out = simplify(ir)
    assert out.outputs[0] is out.inputs[0]
    assert out.outputs[1].op == "add"
    assert _ops(out)["add"] == 1


def test_math_sdpa_with_repeated_kv_heads_reads_the_kv_heads() -> None:
    """The repeated k/v reach the bmm as [B, Hk, G, S, D] views: the attention op takes them as
    [B, H, S, D] and gqa_match then reads the kv heads directly."""
    torch.manual_seed(3)
    model = GQAAttention("repeat_kv", bool_mask=True).half().eval()
    x = rand(2, 24, 32, dtype=torch.float16)
    ref, compiled, out = _run_both(model, x, math_path=True)
    nodes = _attention_nodes(compiled)
    assert len(nodes) == 1, _kernels(compiled)
    assert nodes[0].attrs["enable_gqa"] and tuple(nodes[0].inputs[1].shape) == (2, 2, 24, 8)
    assert_close(out, ref, what="math sdpa, repeated kv heads")


@pytest.mark.parametrize("seed", range(300))
def test_bounds_rules_keep_random_index_expressions_exact(seed: int) -> None:
    """Random comparisons of iota arithmetic (sums, differences, literal products, casts, views):
    after simplify the reference gives the same bools, whether or not a rule decided them."""
    import random

    rng = random.Random(seed)
    g = fg.Graph(f"bounds{seed}")
    x = g.tensor((5, 7), name="x")

    def leaf() -> fg.Tensor:
        if rng.random() < 0.3:
            return g.reshape(g.iota((7,), dim=0, dtype=rng.choice(["int32", "int64"])), 1, 7)
        return g.iota((5, 1), dim=0, dtype=rng.choice(["int32", "int64", "float32"]))

    def expr(depth: int) -> fg.Tensor:
        if depth == 0 or rng.random() < 0.3:
            return leaf()
        a = expr(depth - 1)
        kind = rng.choice(["add", "sub", "mul", "cast", "pair"])
        if kind == "cast":
            return g.cast(a, rng.choice(["int32", "int64", "float32", "float16"]))
        if kind == "pair":
            b = expr(depth - 1)
            return g.add(a, b) if rng.random() < 0.5 else g.sub(a, b)
        c = rng.choice([-3, -1, 0, 1, 2, 5, 40000, 2147483000])
        return {"add": g.add, "sub": g.sub, "mul": g.mul}[kind](a, c)

    conds = []
    for _ in range(3):
        op = rng.choice([g.ge, g.gt, g.le, g.lt, g.eq, g.ne])
        conds.append(op(expr(3), rng.choice([-10, -1, 0, 3, 6, 100, 70000])))
    out = x
    for c in conds:
        out = g.where(g.expand(c, 5, 7), out, g.neg(out))
    out.set_output()
    ir = g.to_ir()
    simplified = simplify(ir)
    feed = rand(5, 7)
    assert torch.equal(fg.reference(simplified)(feed), fg.reference(ir)(feed))
