"""Cross-entropy joint-graph rewrite (frontends/loss_rewrite.py): the forward saves the logits (in their own
dtype) and a per-row logsumexp instead of an fp32 log-softmax of [tokens, vocab]; the backward is one
pointwise pass. Numerics against eager torch; structure from the partitioned graphs and the plans."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close
from fusegraph.frontends import torch_backend
from fusegraph.frontends.loss_rewrite import rewrite_log_softmax_for_backward

aten = torch.ops.aten
TOKENS, HIDDEN = 64, 32


@dataclass
class Captured:
    """What partition_fn saw: rewrite counts, the tensors the forward saves for the backward (fake
    values) and the ops of both graphs, taken before the graphs are compiled (which splits them)."""

    counts: list[int] = field(default_factory=list)
    saved_vals: list[torch.Tensor] = field(default_factory=list)
    ops: set[Any] = field(default_factory=set)

    def saved(self) -> list[torch.Tensor]:
        return self.saved_vals

    def targets(self) -> set[Any]:
        return self.ops

    def add(self, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        names = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        output = next(n for n in fw.graph.nodes if n.op == "output")
        self.saved_vals += [a.meta["val"] for a in output.args[0] if isinstance(a, fx.Node) and a.name in names]
        self.ops |= {n.target for g in (fw, bw) for n in g.graph.nodes}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    """Every test compiles LMHead.forward anew: no cached frame, no recompile limit reached."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    record = Captured()
    real_partition_fn, real_rewrite = torch_backend.partition_fn, torch_backend.rewrite_log_softmax_for_backward

    def counting_rewrite(gm: fx.GraphModule) -> int:
        record.counts.append(real_rewrite(gm))
        return record.counts[-1]

    def partition_fn(split: dict[str, Any] | None = None) -> Callable[..., Any]:
        base = real_partition_fn(split)

        def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            fw, bw = base(joint, inputs, **kwargs)
            record.add(fw, bw)
            return fw, bw
        return partition

    monkeypatch.setattr(torch_backend, "rewrite_log_softmax_for_backward", counting_rewrite)
    monkeypatch.setattr(torch_backend, "partition_fn", partition_fn)
    return record


class LMHead(nn.Module):
    """Embedding -> linear head -> (upcast) logits -> cross-entropy, like a language model's loss."""

    def __init__(self, vocab: int, reduction: str = "mean", label_smoothing: float = 0.0, upcast: bool = True):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, HIDDEN), nn.Linear(HIDDEN, vocab, bias=False)
        self.vocab, self.reduction, self.label_smoothing, self.upcast = vocab, reduction, label_smoothing, upcast

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        logits = (logits.float() if self.upcast else logits).view(-1, self.vocab)
        return F.cross_entropy(logits, target.view(-1), ignore_index=-100, reduction=self.reduction,
                               label_smoothing=self.label_smoothing)


class LogitsTable(nn.Module):
    """Logits looked up from a table (no matmul: bf16 runs right under the Triton interpreter)."""

    def __init__(self, vocab: int, dtype: torch.dtype):
        super().__init__()
        self.table = nn.Embedding(vocab, vocab).to(dtype)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.table(ids).float().view(-1, self.vocab)
        return F.cross_entropy(logits, target.view(-1), ignore_index=-100)


def _data(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, TOKENS // 2), generator=gen)
    target = torch.randint(0, vocab, (2, TOKENS // 2), generator=gen)
    target[0, :5] = -100          # ignored positions
    target[1, -1] = -100
    return ids, target


def _check_training(model: nn.Module, *inputs: torch.Tensor, grad_tol: float | None = None) -> Any:
    """Loss (with a random upstream gradient) and every parameter gradient match eager torch."""
    compiled_model = copy.deepcopy(model)
    compiled = fg.compile(compiled_model)
    out = compiled(*inputs)
    ref = model(*inputs)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref.dtype)
    out.backward(upstream)
    ref.backward(upstream)
    assert_close(out, ref, what="loss")
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters(), strict=True):
        assert q.grad is not None, name
        assert_close(q.grad, p.grad, tol=grad_tol, what=f"grad {name}")
    return compiled


@pytest.mark.parametrize("vocab", [1000, 1003])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32_lm_head_matches_eager(captured: Captured, vocab: int, reduction: str) -> None:
    _check_training(LMHead(vocab, reduction), *_data(vocab))
    assert captured.counts == [2]        # the log-softmax, and the one-hot gradient's row sums
    assert aten._log_softmax.default not in captured.targets()
    # only the logits themselves are saved at [tokens, vocab]; plus lse [tokens, 1]
    big = [t for t in captured.saved() if t.numel() >= TOKENS * vocab]
    assert len(big) == 1 and big[0].dtype == torch.float32
    assert any(tuple(t.shape) == (TOKENS, 1) and t.dtype == torch.float32 for t in captured.saved())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_smoothing_matches_eager(captured: Captured, reduction: str) -> None:
    _check_training(LMHead(1003, reduction, label_smoothing=0.1), *_data(1003))
    assert captured.counts == [1]
    assert aten._log_softmax.default not in captured.targets()


# the log-sum-exp kernel reads a stored fp16 -> fp32 cast: generated, not run through the reference
@pytest.mark.filterwarnings("error::fusegraph.lower.FusionFallbackWarning")
@pytest.mark.parametrize("vocab", [1000, 1003])
def test_float16_upcast_saves_half_logits_and_lse(captured: Captured, vocab: int) -> None:
    compiled = _check_training(LMHead(vocab).half(), *_data(vocab))
    assert captured.counts == [2]
    saved = captured.saved()
    assert not [t for t in saved if t.numel() >= TOKENS * vocab and t.dtype == torch.float32], \
        [(tuple(t.shape), t.dtype) for t in saved]
    assert [t.dtype for t in saved if t.numel() >= TOKENS * vocab] == [torch.float16]
    report = compiled.fusegraph_report
    assert report.fallback_ops == {}
    forward, backward = (next(g for g in report.graphs if g.kind == kind) for kind in ("forward", "backward"))
    # forward: one reduction over [tokens, vocab] (max, exp, sum: the logsumexp); backward: the logits'
    # gradient is one pointwise kernel (softmax - one-hot, scaled, cast to fp16)
    fw_softmax = [k for p in forward.partitions for k in p.kernel_ops if "exp" in k.split(": ")[1].split("+")]
    bw_softmax = [k for p in backward.partitions for k in p.kernel_ops if "exp" in k.split(": ")[1].split("+")]
    assert len(fw_softmax) == 1 and fw_softmax[0].startswith("reduction/"), fw_softmax
    assert len(bw_softmax) == 1 and bw_softmax[0].startswith("pointwise/"), bw_softmax


def test_bfloat16_logits_without_dots(captured: Captured) -> None:
    vocab = 1003
    _check_training(LogitsTable(vocab, torch.bfloat16), *_data(vocab))
    assert captured.counts == [2]
    assert [t.dtype for t in captured.saved() if t.numel() >= TOKENS * vocab] == [torch.bfloat16]


def test_log_softmax_over_dim_0_with_weights(captured: Captured) -> None:
    class WeightedLogSoftmax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 40))
            self.register_buffer("c", torch.rand(24, 40))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -(F.log_softmax(x * self.w, dim=0) * self.c).sum()

    _check_training(WeightedLogSoftmax(), torch.randn(24, 40))
    assert captured.counts == [1]
    assert aten._log_softmax.default not in captured.targets()


def test_other_backward_readers_are_left_alone(captured: Captured) -> None:
    class SquaredLogProbs(nn.Module):       # the backward reads the log-softmax through pow's gradient
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 50))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (F.log_softmax(x * self.w, dim=-1) ** 2).sum()

    _check_training(SquaredLogProbs(), torch.randn(16, 50))
    assert captured.counts == [0]
    assert aten._log_softmax.default in captured.targets()


def test_inference_graph_is_left_alone() -> None:
    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(F.log_softmax(x, -1), t)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.randn(8, 10),
                                                                             torch.randint(0, 10, (8,)))
    before = str(gm.graph)
    assert rewrite_log_softmax_for_backward(gm) == 0
    assert str(gm.graph) == before
    model = LMHead(100)
    with torch.no_grad():
        assert_close(fg.compile(model)(*_data(100)), model(*_data(100)))


def test_undecomposed_log_softmax_backward_data() -> None:
    """A joint graph traced without decompositions keeps _log_softmax_backward_data: it is replaced."""
    from functorch.compile import aot_function, default_partition

    seen: list[set[Any]] = []

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        assert aten._log_softmax_backward_data.default in {n.target for n in joint.graph.nodes}
        assert rewrite_log_softmax_for_backward(joint) == 2
        fw, bw = default_partition(joint, inputs, **kwargs)
        seen.append({n.target for g in (fw, bw) for n in g.graph.nodes})
        return fw, bw

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), t, ignore_index=-100)

    def keep(gm: fx.GraphModule, _: Any) -> Callable[..., Any]:
        return gm

    x = torch.randn(TOKENS, 300, dtype=torch.float64).half().requires_grad_()
    t = torch.randint(0, 300, (TOKENS,))
    t[:4] = -100
    loss = aot_function(f, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)(x, t)
    loss.backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = f(ref_x, t)
    ref.backward()
    assert seen and aten._log_softmax_backward_data.default not in seen[0] and aten._log_softmax.default not in seen[0]
    assert_close(loss, ref, what="loss")
    assert_close(x.grad, ref_x.grad, what="grad")
