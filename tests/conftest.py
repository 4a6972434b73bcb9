"""Shared test helpers: fresh random data, relative-norm comparison with tolerances by dtype, small conv groups."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # generated Triton kernels run on CPU tensors

import pytest
import torch

# ||out - ref|| / ||ref|| limits by the dtype of the compared output.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
    torch.float8_e4m3fn: 1e-1,
    torch.float8_e5m2: 2e-1,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None, what: str = "") -> None:
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if not out.dtype.is_floating_point:
        assert torch.equal(out.cpu(), ref.to(out.dtype).cpu()), f"{what}: values differ"
        return
    limit = tol if tol is not None else TOLERANCE.get(out.dtype, 1e-5)
    err = rel_err(out, ref)
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.1e}"


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", low: float | None = None,
         seed: int | None = None) -> torch.Tensor:
    """Fresh random data (never zeros); `low` shifts to strictly positive values (for log/sqrt)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    t = torch.randn(*shape, generator=gen, dtype=torch.float32)
    if low is not None:
        t = t.abs() + low
    return t.to(dtype=dtype, device=device)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def single_conv_group(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, activation: str = "relu",
                      bias: bool = True, layout: str | None = "NHWC", dtype: str = "float16", stride: int = 1,
                      padding: int = 1, groups: int = 1) -> Any:
    """The one ConvGroup (conv + bias + activation, as the epilogue pass claims it) of a small graph
    built on the CPU: what conv backend tests hand to their candidate builders."""
    import fusegraph as fg
    from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    g = fg.Graph(name=f"conv_{activation or 'none'}", compute_dtype="float32")
    x = g.tensor(x_shape, dtype=dtype, name="x", **({"layout": layout} if layout else {}))
    w = g.tensor(w_shape, dtype=dtype, name="w")
    b = g.tensor((w_shape[0],), dtype=dtype, name="b") if bias else None
    y = g.conv2d(x, w, b, stride=stride, padding=padding, groups=groups)
    if activation:
        y = getattr(g, activation)(y)
    y.set_output()
    plan = g.build(device="cpu")
    (item,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(item, ConvGroup)
    return item


@pytest.fixture
def in_process_workers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    """Build workers that are this process (the stand-in cudnn lives here), on the CPU: each submitted
    job runs at once, without its device index; the list records (function, args) of each job."""
    from concurrent.futures import Future

    from fusegraph.backends import build_workers

    jobs: list[tuple[str, tuple[Any, ...]]] = []

    class InProcess:
        def submit(self, function: str, *args: Any) -> Future[Any]:
            jobs.append((function, args))
            done: Future[Any] = Future()
            done.set_result(build_workers.run_job(function, (*args[:-1], None)))
            return done

    monkeypatch.setattr(build_workers, "pool", lambda: InProcess())
    return jobs


def tiny_lm_head_step(monkeypatch: pytest.MonkeyPatch, vocab: int, dim: int) -> list[Any]:
    """One fp16 training step of embedding -> tanh -> linear LM head (no bias) -> cross-entropy through
    fg.compile (AOTAutograd), beside eager: asserts the loss, the returned logits (values and strides)
    and every gradient match; returns the Plans built (forward and backward)."""
    import torch.nn as nn
    import torch.nn.functional as F

    import fusegraph as fg
    from fusegraph.runtime import plan as plan_module

    plans: list[Any] = []
    original = plan_module.Plan.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plans.append(self)

    monkeypatch.setattr(plan_module.Plan, "__init__", record)
    torch._dynamo.reset()

    class TinyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, idx: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.head(torch.tanh(self.emb(idx)))
            return F.cross_entropy(logits.float().view(-1, vocab), target.view(-1)), logits

    torch.manual_seed(0)
    model = TinyHead().half()
    eager = TinyHead().half()
    eager.load_state_dict(model.state_dict())
    idx, target = torch.randint(0, vocab, (4, 16)), torch.randint(0, vocab, (4, 16))
    loss, logits = fg.compile(model)(idx, target)
    loss.backward()
    ref_loss, ref_logits = eager(idx, target)
    ref_loss.backward()
    assert_close(loss.detach().float(), ref_loss.detach().float(), tol=5e-3)
    assert logits.shape == ref_logits.shape and logits.stride() == ref_logits.stride()
    assert_close(logits.detach().float(), ref_logits.detach().float(), tol=5e-3)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        assert_close(p.grad.float(), q.grad.float(), tol=5e-3, what=name)
    torch._dynamo.reset()
    return plans
