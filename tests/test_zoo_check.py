"""The zoo's correctness check (bench/zoo.py) cannot pass vacuously: zero-initialized weights (timm's
MLP-Mixer head) are randomized before the comparison, and an all-zero eager output fails."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import zoo


def test_zero_initialized_weights_are_randomized_and_others_kept():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    torch.nn.init.zeros_(model[1].weight)
    torch.nn.init.zeros_(model[1].bias)
    kept = model[0].weight.detach().clone()
    assert zoo.randomize_zero_weights(model) == ["1.weight"]
    assert model[1].weight.abs().sum() > 0 and not model[1].bias.any()   # biases stay as built
    assert torch.equal(model[0].weight, kept)
    assert model(torch.randn(2, 8)).abs().sum() > 0


def test_an_all_zero_reference_fails_the_check():
    zeros = torch.zeros(4, 10)
    row = zoo.check(zeros, zeros, None, torch.float32)
    assert row["ok"] is False and "all zeros" in row["degenerate"]
    ref = torch.randn(4, 10)
    assert zoo.check(ref.clone(), ref, None, torch.float32)["ok"] is True
    assert zoo.check(ref + 1.0, ref, None, torch.float32)["ok"] is False


def test_training_table_shows_compile_time_and_peak_memory():
    """bench/zoo.py --train's table: fusegraph's compile time (its first forward + backward), not its
    first timed step, beside torch.compile's first step; peak MiB per implementation; a skipped row
    keeps the column count."""
    import zoo_train

    row = {"model": "tv_resnet50", "batch": 64, "ok": True, "worst": "fc.bias", "eager_step_ms": 29.7,
           "inductor_step_ms": 27.2, "fusegraph_step_ms": 13.9, "speedup_vs_inductor": 1.96, "speedup_vs_eager": 2.14,
           "inductor_first_step_s": 38.7, "fusegraph_first_step_s": 0.2, "fusegraph_compile_s": 52.0,
           "eager_peak_mib": 5000.0, "inductor_peak_mib": 4000.0, "fusegraph_peak_mib": 3000.0, "fallback_ops": {}}
    table = zoo_train.markdown_train([row, {"model": "hf_gpt2", "skipped": "time budget"}], "## t")
    lines = table.splitlines()
    assert "| 38.7/52.0 | 5000/4000/3000 |" in lines[-2]
    assert lines[-2].count("|") == lines[2].count("|") == lines[-1].count("|")
