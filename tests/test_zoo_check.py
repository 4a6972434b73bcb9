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
