"""The fusegraph command: --help, version (text and JSON), demo on CPU, the console script."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import fusegraph
from fusegraph.cli import COMMAND_MODULES, build_parser, main


def test_console_script_entry_point() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    entry = [e for e in scripts if e.name == "fusegraph"]
    assert entry, "the console script 'fusegraph' is not installed (pip install -e .)"
    assert entry[0].value == "fusegraph.cli:main"
    assert entry[0].load() is main


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "version"):
        assert command in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "usage: fusegraph" in capsys.readouterr().out


def test_every_command_module_registers() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"demo", "version"} <= set(sub.choices)  # type: ignore[arg-type]
    assert "fusegraph.commands.demo" in COMMAND_MODULES


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:  # type: ignore[union-attr]
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0, name
        assert f"usage: fusegraph {name}" in capsys.readouterr().out


def test_python_dash_m_and_version_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "fusegraph", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fusegraph {fusegraph.__version__}"


def test_version_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert fusegraph.__version__ in out
    assert torch.__version__ in out
    for key in ("python", "triton", "numpy", "cuda", "cudnn", "nvidia-cudnn-frontend", "jax"):
        assert key in out
    if not torch.cuda.is_available():
        assert "no GPU" in out


def test_version_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fusegraph"] == fusegraph.__version__
    assert info["torch"] == torch.__version__
    assert info["cuda"] == torch.version.cuda
    assert isinstance(info["gpus"], list)
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for key in ("python", "triton", "numpy", "cudnn", "nvidia-cudnn-frontend", "jax"):
        assert key in info


def test_demo_small_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--size", "small", "--device", "cpu", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "plan for transformer_block on cpu" in out and "plan for conv_block on cpu" in out  # kernel lists
    assert "-- plan.explain() --" in out and "-- graph after passes --" in out
    assert "needs a GPU" in out
    assert "device time per call" not in out and "latency of one call" not in out  # no timings without a GPU
    assert out.count("-> OK") == 2


def test_demo_rejects_unknown_device() -> None:
    with pytest.raises(SystemExit, match="--device must be cpu or cuda"):
        main(["demo", "--device", "tpu"])
