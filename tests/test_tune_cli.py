"""`fusegraph cache info` / `fusegraph cache clear` through fusegraph.cli.main."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fusegraph.cli import main
from fusegraph.settings import override
from fusegraph.tune import CacheEntry, Config, TuneCache
from fusegraph.tune.keys import full_key, library_versions

GPU = {"name": "Fake GPU", "capability": "9.0"}
CANDIDATES = [Config.of(BLOCK_C=1024), Config.of(BLOCK_C=2048)]


@pytest.fixture
def cache(tmp_path: Path):
    with override(cache_dir=str(tmp_path)):
        cache = TuneCache()
        for name, shape in [("fused_softmax_0", 4096), ("fused_softmax_0", 8192), ("fused_layernorm_1", 4096)]:
            cache.store(full_key(name, {"shape": shape}, CANDIDATES, GPU), CacheEntry(CANDIDATES[0]))
        old = {**library_versions(), "torch": "1.0.0"}
        cache.store(full_key("fused_softmax_0", {"shape": 4096}, CANDIDATES, GPU, old), CacheEntry(CANDIDATES[1]))
        yield cache


def test_info(cache: TuneCache, capsys):
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache.directory) in out and "entries: 4" in out and "stale (other library versions): 1" in out
    assert re.search(r"fused_softmax_0 +3\n", out) and re.search(r"fused_layernorm_1 +1\n", out)
    assert main(["cache", "info", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["entries"] == 4 and summary["stale"] == 1 and summary["corrupt"] == 0
    assert summary["kernels"] == {"fused_layernorm_1": 1, "fused_softmax_0": 3} and summary["bytes"] > 0


def test_clear_stale_then_by_name_then_all(cache: TuneCache, capsys):
    (cache.directory / ("f" * 64 + ".json")).write_bytes(b"\x00garbage")
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 2 stale or unreadable entries" in capsys.readouterr().out
    assert len(cache.entry_paths()) == 3
    assert main(["cache", "clear", "--name", "fused_layernorm_1"]) == 0
    assert "removed 1 entry of kernel 'fused_layernorm_1'" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert cache.entry_paths() == []
    assert main(["cache", "info"]) == 0
    assert "entries: 0" in capsys.readouterr().out


def test_cache_without_action_prints_help(cache: TuneCache, capsys):
    assert main(["cache"]) == 0
    assert "info" in capsys.readouterr().out


def test_stored_cudnn_plans_are_counted_and_cleared_with_the_cache(cache: TuneCache, capsys):
    from fusegraph.backends import cudnn_plans

    key = {"schema": 1, "recipes": [], "gpu": GPU, "cudnn": "91900"}
    assert cudnn_plans.store(key, 0, 2, b"\x01serialized plan") is not None
    assert cudnn_plans.load(key) == (0, 2, b"\x01serialized plan")
    assert main(["cache", "info", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["cudnn_plans"] == 1 and summary["cudnn_plan_bytes"] > 0
    assert main(["cache", "clear", "--stale"]) == 0          # stale tuning entries only: the plan stays
    assert len(cudnn_plans.stored()) == 1
    assert main(["cache", "clear"]) == 0
    assert "removed 1 cuDNN plan" in capsys.readouterr().out and cudnn_plans.stored() == []
