"""How an attention node picks among its candidates (backends/attention_kernel._choose) and how the
cuDNN frontend's SDPA candidate is built (backends/cudnn_frontend.sdpa_candidate), on CPU with
stand-in candidates and a fake GPU identity: each candidate is checked against a torch backend on its
first call, inside its timing, so a wrong one is a failed candidate and never chosen; a choice
remembered in this process (another layer of the same problem) calls no candidate; one from the disk
cache calls only itself and the torch baseline; the frontend graph is built at its first call, once
per problem for every node that has it."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusegraph.backends import attention_kernel, cudnn_frontend
from fusegraph.settings import override

COSTS: list[float] = []
WANT = torch.arange(12.0).reshape(3, 4)


class Candidate:
    """A launch returning the right result (or a wrong one, or raising) that "takes" `ms` when timed."""

    def __init__(self, ms: float, wrong: bool = False, fails: bool = False) -> None:
        self.ms, self.wrong, self.fails, self.calls = ms, wrong, fails, 0

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        if self.fails:
            raise RuntimeError("does not take this problem")
        COSTS.append(self.ms)
        return [WANT + 1.0 if self.wrong else WANT.clone()]


def fake_bench_ms(fn: Any, **kw: Any) -> float:
    COSTS.clear()
    fn()
    return COSTS[-1]


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    import fusegraph.tune
    from fusegraph.tune import autotuner, clear_memo, keys

    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "Fake GPU H200", "capability": "9.0"})
    monkeypatch.setattr(fusegraph.tune, "bench_ms", fake_bench_ms)
    monkeypatch.setattr(autotuner, "floor_ms_of", lambda kernel: 1.0)      # worth timing
    monkeypatch.setattr(attention_kernel, "_example_inputs", lambda node, device: [torch.ones(3, 4)])
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield
    clear_memo()


NODE = SimpleNamespace(op="scaled_dot_product_attention", attrs={"is_causal": True})


def choose(candidates: dict[str, Candidate]) -> tuple[str | None, Any]:
    kernel = SimpleNamespace(name="fg_k0_scaled_dot_product_attention", tuning=None)
    chosen = attention_kernel._choose(kernel, NODE, "problem(b8 h12 s1024 d64)", dict(candidates), "cuda")
    return chosen, kernel


def made() -> dict[str, Candidate]:
    return {"triton:fast_wrong": Candidate(0.1, wrong=True), "triton:ok": Candidate(0.3),
            "torch:cudnn": Candidate(0.5), "frontend:cudnn": Candidate(0.2), "lse:flash": Candidate(0.05, fails=True)}


@pytest.mark.usefixtures("fake_gpu")
def test_the_fastest_correct_candidate_wins_and_a_wrong_one_never() -> None:
    cands = made()
    chosen, kernel = choose(cands)
    assert chosen == "frontend:cudnn" and kernel.tuning["source"] == "tuned"
    assert cands["triton:fast_wrong"].calls == 1 and cands["lse:flash"].calls == 1   # checked once, never timed


@pytest.mark.usefixtures("fake_gpu")
def test_another_layer_of_the_same_problem_calls_no_candidate() -> None:
    choose(made())
    cands = made()
    chosen, kernel = choose(cands)
    assert chosen == "frontend:cudnn" and kernel.tuning["source"] == "memo"
    assert all(c.calls == 0 for c in cands.values())


@pytest.mark.usefixtures("fake_gpu")
def test_a_disk_cache_choice_runs_only_itself() -> None:
    from fusegraph.tune import clear_memo

    choose(made())
    clear_memo()                                   # a new process: the choice comes from the disk cache
    cands = made()
    assert choose(cands)[0] == "frontend:cudnn"
    assert [label for label, c in cands.items() if c.calls] == ["frontend:cudnn"]
    clear_memo()
    cands = made()
    cands["frontend:cudnn"].fails = True           # the cached winner no longer runs here: the next that does
    assert choose(cands)[0] == "triton:ok"
    assert cands["triton:fast_wrong"].calls == 1 and cands["torch:cudnn"].calls >= 1


@pytest.mark.usefixtures("fake_gpu")
def test_none_runs_gives_the_reference() -> None:
    assert choose({"triton:a": Candidate(0.1, fails=True), "frontend:cudnn": Candidate(0.1, fails=True)})[0] is None


def test_frontend_sdpa_is_built_at_first_call_once_per_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[str] = []
    kept: list[str] = []

    def plan(node: Any, problem: Any, device: Any, name: str) -> Any:
        builds.append(node.name)
        if problem == "broken":
            raise RuntimeError("no engine for this graph")
        return (lambda args: [args[0] * 2]), (lambda: kept.append(name))

    monkeypatch.setattr(cudnn_frontend, "unavailable", lambda device: None)
    monkeypatch.setattr(cudnn_frontend, "sdpa_unsupported", lambda node, problem: None)
    monkeypatch.setattr(cudnn_frontend, "_sdpa_plan", plan)
    monkeypatch.setattr(cudnn_frontend, "_check_sdpa", lambda *a: None)
    monkeypatch.setattr(cudnn_frontend, "_SDPA_BUILT", {})
    spec = SimpleNamespace(shape=(2, 3), memory_strides=(3, 1), dtype="float16")

    def node(name: str) -> Any:
        return SimpleNamespace(name=name, op="scaled_dot_product_attention", attrs={},
                               inputs=[SimpleNamespace(spec=spec, dtype="float16")] * 3, specs=[spec])

    layers = [cudnn_frontend.sdpa_candidate(node(f"attn{k}"), "problem", "cpu", f"attn{k}") for k in range(3)]
    assert builds == []                                            # offered, not built
    x = torch.ones(2, 3)
    assert all(torch.equal(launch([x])[0], x * 2) for launch in layers if launch is not None)
    assert builds == ["attn0"] and kept == ["attn0"]               # one graph for the three layers, stored
    broken = [cudnn_frontend.sdpa_candidate(node(f"b{k}"), "broken", "cpu", f"b{k}") for k in range(2)]
    for launch in broken:
        assert launch is not None
        with pytest.raises(RuntimeError, match="no engine"):
            launch([x])
    assert builds == ["attn0", "b0"]                               # a failed build is not retried per node
