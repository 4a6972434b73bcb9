"""Memory-bound row kernels read each big input once per row: cross-entropy (max, sum-exp and the
target logit from one load of the logits) and layernorm backward (dx, dw, db from one load of g and
x per row tile). Every load is issued before the first reduction (a load after a reduction waits
for its barriers: a second round trip to memory). Every autotune candidate is run through the
interpreter against the reference, with rows that divide the programs' rows (masks fold to
constants) and rows that do not."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import fusegraph as fg
import fusegraph.lower as lower
from conftest import assert_close, rand
from fusegraph.codegen.configs import _row_column_configs, candidate_configs


def _cross_entropy(m: int, n: int) -> tuple[fg.Graph, list[torch.Tensor]]:
    g = fg.Graph("ce_single_read")
    x, t = g.tensor((m, n), "bfloat16", "x"), g.tensor((m,), "int64", "t")
    g.cross_entropy(x, t).set_output()
    return g, [rand(m, n, dtype=torch.bfloat16), torch.randint(0, n, (m,))]


def _layernorm_backward(m: int, n: int) -> tuple[fg.Graph, list[torch.Tensor]]:
    g = fg.Graph("lnb_single_read")
    gy, x, w = g.tensor((m, n), "bfloat16", "g"), g.tensor((m, n), "bfloat16", "x"), g.tensor((n,), "bfloat16", "w")
    for out in g.layernorm_backward(gy, x, weight=w, eps=1e-5):
        out.set_output()
    return g, [rand(m, n, dtype=torch.bfloat16), rand(m, n, dtype=torch.bfloat16), rand(n, dtype=torch.bfloat16)]


def _first_kernel_body(source: str) -> list[str]:
    """Lines of the first @triton.jit function (the partial / row kernel, not the finish)."""
    body = source.split("@triton.jit")[1]
    return body.splitlines()


def _loads_of(lines: list[str], ptr: str) -> list[int]:
    return [k for k, line in enumerate(lines) if f"tl.load({ptr} +" in line]


def _first_reduction(lines: list[str]) -> int:
    return next(k for k, line in enumerate(lines) if re.search(r"= tl\.(sum|max|min|reduce)\(", line))


def _check(g: fg.Graph, feeds: list[torch.Tensor]) -> None:
    plan = g.build()
    assert all(k.backend == "triton" for k in plan.kernels), [(k.name, k.note) for k in plan.kernels]
    outs = plan(*feeds)
    refs = fg.reference(g)(*feeds)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, what=f"output {k}")


def test_cross_entropy_reads_the_logits_once_before_any_reduction() -> None:
    g, _ = _cross_entropy(64, 256)
    plan = g.build()
    assert len(plan.kernels) == 1, "per-row loss and its mean in one pass (+ a finish over partials)"
    source = plan.kernels[0].source
    assert "_finish" in source
    lines = _first_kernel_body(source)
    loop = next(k for k, line in enumerate(lines) if line.strip().startswith("for "))
    assert "for r0 in tl.range(0, RPP, ROWS, num_stages=STAGES)" in lines[loop]
    assert sum(line.strip().startswith("for ") for line in lines) == 1, "no second pass over the row"
    body = [line for line in lines[loop + 1:] if line.startswith("        ")]
    logits = _loads_of(body, "in0")
    assert len(logits) == 2, "the logits' row once, and the target logit gathered (one element)"
    assert sum("+ cols," in body[k] for k in logits) == 1
    assert sum(bool(re.search(r"= tl\.sum\(", line)) for line in body) == 1, "one row sum: of the exps"
    assert "tl.math.exp2(" in "\n".join(body), "exp(x - max) is one FFMA and an ftz ex2"
    loads = [k for k, line in enumerate(body) if "tl.load(" in line]
    assert max(loads) < _first_reduction(body), "the target (and its logit) load before the max"
    assert "| (64 % RPP == 0)" in "\n".join(body), "rows that divide fold the row mask"
    assert "acc_" in body[-1] and "[ROWS, 1]" in "\n".join(lines[:loop]), "per-row loss partials"


def test_layernorm_backward_reads_g_and_x_once_per_row_tile() -> None:
    g, _ = _layernorm_backward(64, 256)
    plan = g.build()
    assert len(plan.kernels) == 1
    lines = _first_kernel_body(plan.kernels[0].source)
    loop = next(k for k, line in enumerate(lines) if line.strip().startswith("for "))
    assert "for r0 in tl.range(0, RPP, ROWS, num_stages=STAGES)" in lines[loop]
    assert sum(line.strip().startswith("for ") for line in lines) == 1, "one pass over the rows"
    gy, x, w = (_loads_of(lines, p) for p in ("in0", "in1", "in2"))
    assert len(gy) == 1 and len(x) == 1, "g and x are loaded once per row tile"
    assert len(w) == 1 and w[0] < loop, "the weight is loaded once per program, before the loop"
    assert max(gy + x) < _first_reduction(lines), "both tiles are loaded before the first reduction"


def test_layernorm_backward_row_sums_run_in_three_rounds() -> None:
    """sum(x) and sum(g * w) do not depend on each other: one two-operand tl.reduce (one shared
    memory exchange, one set of barriers); then sum((x - mean)^2), then sum(g * w * xhat). The
    dx term g * w - mean(g * w) is computed after the last reduction, not held across two."""
    g, _ = _layernorm_backward(64, 256)
    source = g.build().kernels[0].source
    lines = _first_kernel_body(source)
    row_reduction = r"= tl\.(sum|max|min|reduce)\(.*(axis=1|, 1, _combine)"
    rounds = [k for k, line in enumerate(lines) if re.search(row_reduction, line)]
    assert len(rounds) == 3, [lines[k] for k in rounds]
    first = lines[rounds[0]]
    assert "tl.reduce((" in first and first.count("tl.where(mask,") == 2 and "_combine_sum_sum" in first
    assert "def _combine_sum_sum(a0, a1, b0, b1):\n    return a0 + b0, a1 + b1" in source
    centered = next(k for k, line in enumerate(lines) if re.search(r"= \(v\d+_\w+ - v\d+_\w+\)$", line.strip())
                    and "mul - " in line)
    assert centered > rounds[-1], lines[centered]


def _each_candidate(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    original = lower.candidate_configs

    def pick(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        cands = original(gen, options)
        return [cands[index % len(cands)]]

    monkeypatch.setattr(lower, "candidate_configs", pick)


@pytest.mark.parametrize("m", [64, 60])
@pytest.mark.parametrize("index", range(7))
def test_cross_entropy_every_candidate_matches_reference(monkeypatch: pytest.MonkeyPatch, m: int, index: int) -> None:
    _each_candidate(monkeypatch, index)
    _check(*_cross_entropy(m, 256))


@pytest.mark.parametrize("m", [64, 60])
@pytest.mark.parametrize("index", range(8))
def test_layernorm_backward_every_candidate_matches_reference(monkeypatch: pytest.MonkeyPatch, m: int,
                                                              index: int) -> None:
    _each_candidate(monkeypatch, index)
    _check(*_layernorm_backward(m, 256))


def test_row_column_candidates_cover_warps_stages_and_fill_the_gpu() -> None:
    cands = _row_column_configs(16384, 4096)
    assert cands[0]["STAGES"] == 2 and cands[0]["num_warps"] == 8 and cands[0]["RPP"] == 64
    assert {c["num_warps"] for c in cands} == {4, 8, 16}
    assert {c["STAGES"] for c in cands} == {1, 2, 3}
    for c in cands:
        assert c["RPP"] % c["ROWS"] == 0 and 16384 % c["RPP"] == 0   # the row mask folds
        assert c["SPLITS"] * c["RPP"] == 16384 and 128 <= c["SPLITS"] <= 512   # partials stay small


def test_row_reduction_candidates_offer_more_rows_per_program() -> None:
    from fusegraph.codegen.triton_gen import GeneratedKernel

    gen = GeneratedKernel("k", "", "reduction", [], [], extent=32768, reduced_extent=4096)
    cands = candidate_configs(gen)
    assert cands[0] == {"ROWS": 1, "BLOCK_C": 4096, "num_warps": 8}
    pairs = {(c["ROWS"], c["num_warps"]) for c in cands}
    assert {(1, 4), (1, 16), (2, 16), (2, 8), (4, 16)} <= pairs


def test_cross_entropy_gather_skips_ignored_targets_and_keeps_label_smoothing() -> None:
    g = fg.Graph("ce_ignore")
    x, t = g.tensor((12, 40), "float32", "x"), g.tensor((12,), "int64", "t")
    g.cross_entropy(x, t, reduction="none").set_output()
    g.cross_entropy(x, t, label_smoothing=0.1).set_output()
    targets = torch.randint(0, 40, (12,))
    targets[[1, 5, 11]] = -100
    plan = g.build()
    assert any("_at = tl.where(" in k.source for k in plan.kernels), "the target logit is gathered"
    _check(g, [rand(12, 40), targets])


@pytest.mark.parametrize("index", [0, 2, 4])
def test_cross_entropy_programs_loop_over_several_row_tiles(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    _each_candidate(monkeypatch, index)
    g, feeds = _cross_entropy(50, 1024)   # 2 rows a tile, 4-16 rows a program, the last one partial
    plan = g.build()
    assert plan.kernels[0].config["RPP"] > plan.kernels[0].config["ROWS"]
    _check(g, feeds)


@pytest.mark.parametrize("index", [0, 4])
def test_layernorm_backward_programs_loop_over_several_row_tiles(monkeypatch: pytest.MonkeyPatch,
                                                                 index: int) -> None:
    _each_candidate(monkeypatch, index)
    g, feeds = _layernorm_backward(1100, 512)   # 4 rows a tile, 8-16 rows a program, the last partial
    plan = g.build()
    assert plan.kernels[0].config["RPP"] > plan.kernels[0].config["ROWS"]
    _check(g, feeds)
