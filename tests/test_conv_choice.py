"""How a conv group picks among its library candidates (backends/conv_kernel._choose), on CPU with
stand-in candidates and a fake GPU identity: each is checked against conv + our epilogue on its first
call, inside its timing, so a wrong one is a failed candidate and never chosen; the fastest correct one
wins; a remembered choice (memo or disk cache) is taken without calling any candidate, so repeated
blocks and warm compiles build no losing candidate; with autotuning off nothing is called."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from conftest import single_conv_group
from fusegraph.backends import conv_kernel
from fusegraph.settings import override

COSTS: list[float] = []   # what the last timed call "took" (the plain path: 1.0 ms)


class Candidate:
    """A library launch computing the plain path's result (or a wrong one) that "takes" `ms` when timed."""

    def __init__(self, plain: Any, ms: float, wrong: bool = False) -> None:
        self.plain, self.ms, self.wrong, self.calls = plain, ms, wrong, 0

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        COSTS.append(self.ms)
        (out,) = self.plain(args)
        return [out + 1.0 if self.wrong else out]


def fake_bench_ms(fn: Any, **kw: Any) -> float:
    COSTS.clear()
    fn()
    return COSTS[-1] if COSTS else 1.0


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    import fusegraph.tune
    from fusegraph.tune import clear_memo, keys

    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "Fake GPU H200", "capability": "9.0"})
    monkeypatch.setattr(fusegraph.tune, "bench_ms", fake_bench_ms)
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield
    clear_memo()


def _build(monkeypatch: pytest.MonkeyPatch, costs: dict[str, tuple[float, bool]]) -> tuple[Any, dict[str, Candidate]]:
    """conv_group_kernel of one conv + bias + relu group, its library candidates the stand-ins."""
    monkeypatch.setattr(conv_kernel, "library_candidates", lambda *a, **kw: {})   # (the group's own build too)
    group = single_conv_group((2, 4, 6, 6), (8, 4, 3, 3), activation="relu")
    plain = conv_kernel.conv_group_kernel(group, "plain", "float32", "cpu", {}).launch
    made = {label: Candidate(plain, ms, wrong) for label, (ms, wrong) in costs.items()}
    monkeypatch.setattr(conv_kernel, "library_candidates", lambda *a, **kw: dict(made))
    return conv_kernel.conv_group_kernel(group, "fg_k0_conv", "float32", "cpu", {}), made


@pytest.mark.usefixtures("fake_gpu")
def test_the_fastest_correct_candidate_wins_and_a_wrong_one_never(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, made = _build(monkeypatch, {"cudnn_frontend_epilogue": (0.1, True), "cudnn_convolution_relu": (0.5, False),
                                        "cudnn_frontend": (2.0, False)})
    assert kernel.config == {"candidate": "cudnn_convolution_relu"} and kernel.tuning["source"] == "tuned"
    assert kernel.tuning["candidates"] == 4
    assert [f.split(":")[0] for f in kernel.tuning["failed"]] == ["cudnn_frontend_epilogue"]   # fast but wrong
    assert made["cudnn_frontend_epilogue"].calls == 1     # checked once, then dropped: never timed


@pytest.mark.usefixtures("fake_gpu")
def test_a_remembered_choice_calls_no_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusegraph.tune import clear_memo

    costs = {"cudnn_convolution_relu": (0.5, False), "cudnn_frontend": (2.0, False)}
    _build(monkeypatch, costs)
    again, made = _build(monkeypatch, costs)                                             # a repeated block
    assert again.config == {"candidate": "cudnn_convolution_relu"} and again.tuning["source"] == "memo"
    assert all(c.calls == 0 for c in made.values())
    clear_memo()                                                                         # a warm compile
    warm, made = _build(monkeypatch, costs)
    assert warm.tuning["source"] == "cache" and all(c.calls == 0 for c in made.values())


def test_without_autotuning_no_candidate_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    with override(autotune=False):
        kernel, made = _build(monkeypatch, {"cudnn_convolution_relu": (0.5, False)})
    assert kernel.config is None or "candidate" not in (kernel.config or {})
    assert made["cudnn_convolution_relu"].calls == 0
