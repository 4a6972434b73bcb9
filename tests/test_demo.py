"""The demo's blocks: the Graph API version and the eager PyTorch version agree, the compiled plan
matches them, and the demo fails (non-zero exit) when a result is wrong."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.cli import main
from fusegraph.commands import demo
from fusegraph.commands.demo_blocks import CONV_OPS, SIZES, TRANSFORMER_OPS, conv_block, transformer_block

TRANSFORMER, CONV = SIZES["small"]
TINY_TRANSFORMER = replace(TRANSFORMER, batch=1, seq=8, dim=32, heads=2, ffn=64)
TINY_CONV = replace(CONV, batch=1, channels=4, height=6, width=6, filters=8)


def test_graph_api_has_every_op_the_demo_uses() -> None:
    assert demo.missing_ops(TRANSFORMER_OPS + CONV_OPS) == []
    assert demo.missing_ops(("add", "no_such_op")) == ["no_such_op"]


@pytest.mark.parametrize("second_norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_transformer_graph_matches_eager(second_norm: str, gelu: str) -> None:
    block = transformer_block(TINY_TRANSFORMER, torch.float32, "cpu", seed=3, second_norm=second_norm,
                              gelu_approximate=gelu)
    eager = block.eager_in(torch.float32)
    assert eager.shape == (TINY_TRANSFORMER.batch, TINY_TRANSFORMER.seq, TINY_TRANSFORMER.dim)
    ops = [n.op for n in block.graph.to_ir().nodes]
    assert ops.count("linear") == 6 and "scaled_dot_product_attention" in ops
    assert_close(fg.reference(block.graph).execute(block.feeds)[block.output], eager, what="reference executor")
    assert_close(block.graph.build(device="cpu").execute(block.feeds)[block.output], eager, tol=1e-4,
                 what="plan")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv_graph_matches_eager(layout: str) -> None:
    block = conv_block(TINY_CONV, torch.float32, "cpu", layout=layout)
    assert (block.feeds[block.graph.inputs()[0]].is_contiguous(memory_format=torch.channels_last)
            == (layout == "NHWC"))
    eager = block.eager_in(torch.float32)
    assert (eager >= 0).all() and (eager > 0).any()  # relu output, not all clipped
    assert_close(fg.reference(block.graph).execute(block.feeds)[block.output], eager, what="reference executor")
    assert_close(block.graph.build(device="cpu").execute(block.feeds)[block.output], eager, tol=1e-4,
                 what="plan")


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"quiet": True, "reps": 5, **kw})


def test_run_block_reports_a_wrong_result(capsys: pytest.CaptureFixture[str]) -> None:
    block = transformer_block(TINY_TRANSFORMER, torch.float32, "cpu")
    right = demo.run_block(block, "cpu", "float32", _args())
    assert right.ok and right.error is not None and right.error < 1e-4
    assert sum(right.kernels.values()) >= 1
    eager = block.eager
    block.eager = lambda t: eager(t) * 1.01        # eager now disagrees by 1%
    wrong = demo.run_block(block, "cpu", "float32", _args())
    assert not wrong.ok and wrong.error is not None and wrong.error > 5e-3
    assert "differs from eager PyTorch" in wrong.failure
    assert "FAILED" in capsys.readouterr().out


def test_demo_exits_nonzero_when_wrong(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def skewed_conv_block(*a: object, **kw: object) -> demo.DemoBlock:
        block = conv_block(TINY_CONV, torch.float32, "cpu", layout="NCHW")
        eager = block.eager
        block.eager = lambda t: eager(t) + 0.5
        return block

    monkeypatch.setattr(demo, "conv_block", skewed_conv_block)
    rc = main(["demo", "--device", "cpu", "--block", "conv", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "conv" in out and "FAILED" in out


def test_demo_variants_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--device", "cpu", "--block", "transformer", "--norm", "rmsnorm", "--gelu", "tanh",
               "--quiet", "--seed", "7"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rmsnorm" in out and "-> OK" in out and "needs a GPU" in out
    rc = main(["demo", "--device", "cpu", "--block", "conv", "--layout", "NCHW", "--quiet"])
    assert rc == 0, capsys.readouterr().out


def test_tolerances_cover_every_demo_dtype() -> None:
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        for device in ("cpu", "cuda"):
            assert 0 < demo.BLOCK_TOLERANCE[(dtype, device)] < 0.1


def test_demo_in_float16_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    # float16, not bfloat16: under TRITON_INTERPRET=1 tl.dot on bfloat16 is wrong (the demo warns about it).
    rc = main(["demo", "--device", "cpu", "--dtype", "float16", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dtype float16" in out and out.count("-> OK") == 2
