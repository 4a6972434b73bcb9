"""The README stays true: its Graph API example runs as written, its settings and paths exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from conftest import assert_close
from fusegraph.settings import settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    """The fenced code blocks of README.md whose info string is `language` ("" for plain fences)."""
    blocks, current, lang = [], [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, current = line[3:].strip(), []
            else:
                if lang == language:
                    blocks.append("\n".join(current) + "\n")
                lang = None
        elif lang is not None:
            current.append(line)
    return blocks


def test_readme_starts_with_the_two_commands() -> None:
    first = code_blocks("")[0]
    assert "make demo" in first and "make test" in first


def test_readme_graph_example_runs_as_written() -> None:
    example = next(b for b in code_blocks("python") if "fg.Graph(" in b)
    scope: dict[str, Any] = {}
    exec(compile(example, "README.md", "exec"), scope)
    x_t, r_t, w_t, b_t = (scope[k] for k in ("x_t", "r_t", "w_t", "b_t"))
    h_t, y_t, outs, ref, y = scope["h_t"], scope["y_t"], scope["outs"], scope["ref"], scope["y"]
    N = x_t.shape[-1]
    expected = F.layer_norm((x_t + r_t).float(), (N,), w_t.float(), b_t.float(), 1e-5)
    assert y_t.dtype == torch.bfloat16 and h_t.dtype == torch.bfloat16
    assert_close(h_t, x_t.float() + r_t.float(), what="h = x + r")
    assert_close(y_t, expected, what="layernorm(x + r)")
    assert torch.equal(outs[y], y_t)
    assert_close(ref[y], expected, what="reference executor")
    assert len(scope["plan"].kernels) >= 1


def test_readme_settings_exist() -> None:
    documented = set(re.findall(r"`(FUSEGRAPH_[A-Z_]+)`", README))
    known = {env for _, env, _, _ in settings.describe()}
    assert documented, "README documents no settings"
    assert documented <= known, f"README documents settings that do not exist: {sorted(documented - known)}"


def test_readme_layout_paths_exist() -> None:
    layout = next(b for b in code_blocks("") if "src/fusegraph/api.py" in b)
    paths = re.findall(r"^(\S+)\s", layout, flags=re.MULTILINE)
    assert paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README's project layout names paths that do not exist: {missing}"


def test_readme_cli_commands_exist() -> None:
    from fusegraph.cli import build_parser

    documented = set(re.findall(r"^\| `fusegraph ([a-z]+)", README, flags=re.MULTILINE))
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    known = set(sub.choices)  # type: ignore[arg-type]
    assert {"demo", "version"} <= documented
    assert documented <= known, f"README documents commands that do not exist: {sorted(documented - known)}"
