"""`fusegraph explain / whatif / calibrate / bench` from the command line, including bad input."""

from __future__ import annotations

import textwrap

import pytest
import torch

from fusegraph.cli import main

SCRIPT = textwrap.dedent("""
    import torch
    import fusegraph as fg

    def build():
        g = fg.Graph(name="cli_block")
        x = g.tensor((16, 32), "float32", name="x")
        w = g.tensor((32,), "float32", name="w")
        g.softmax(g.rmsnorm(x, weight=w), -1).set_output()
        return g.build(device="cpu"), [torch.randn(16, 32), torch.randn(32)]
""")

FAILING = textwrap.dedent("""
    import fusegraph as fg

    def make_weights():
        raise ValueError("weights file is corrupt")

    def build():
        return make_weights()
""")

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without a GPU")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SCRIPT)
    return path


@no_gpu
def test_explain_script_writes_table_html_png(script, tmp_path, capsys) -> None:
    html, png = tmp_path / "r.html", tmp_path / "r.png"
    assert main(["explain", str(script), "--device", "H100", "--html", str(html), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "explain: model on H100" in out and "timings need a GPU" in out and "model.py:" in out
    assert html.read_text().count("<tr>") >= 2 and png.read_bytes()[:4] == b"\x89PNG"


def test_explain_module_target(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "my_block_mod.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "my_block_mod", "--device", "B200", "--no-measure"]) == 0
    assert "explain: my_block_mod on B200" in capsys.readouterr().out


def test_explain_failing_script_shows_its_own_traceback(tmp_path, capsys) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text(FAILING)
    assert main(["explain", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "broken.py" in err and "make_weights" in err
    assert 'raise ValueError("weights file is corrupt")' in err and "ValueError: weights file is corrupt" in err
    assert "loader.py" not in err and "runpy" not in err


def test_explain_target_without_build_and_missing_target(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    assert main(["explain", str(empty)]) == 1
    assert "defines no function build()" in capsys.readouterr().err
    assert main(["explain", "no_such_module_anywhere"]) == 1
    assert "neither a script path nor an importable module" in capsys.readouterr().err


def test_whatif_device_and_custom_spec(script, capsys) -> None:
    assert main(["whatif", str(script), "--device", "B200"]) == 0
    out = capsys.readouterr().out
    assert "projected onto B200" in out and "assumptions:" in out and "sensitivity" in out
    assert main(["whatif", str(script), "--bandwidth", "8TB/s", "--bf16", "2.2PF"]) == 0
    assert "8.00 TB/s" in capsys.readouterr().out


def test_whatif_lists_devices_with_sparse_rates_and_sources(capsys) -> None:
    assert main(["whatif", "--list-devices"]) == 0
    out = capsys.readouterr().out
    for name in ("H100", "H200", "A100", "B200", "L40S", "RTX4090"):
        assert name + ":" in out
    assert out.count("2:4 sparse:") == 6 and out.count("source:") == 6 and "datasheet" in out


def test_whatif_suite_without_target(capsys) -> None:
    assert main(["whatif", "--device", "L40S", "--suite", "softmax", "--shapes", "full"]) == 0
    assert "softmax (full) projected onto L40S" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["whatif", "--device", "X100"], "known devices: H100, H200, A100, B200, L40S, RTX4090"),
    (["whatif", "--bandwidth", "0TB/s", "--bf16", "2PF"], "bandwidth: must be a positive number"),
    (["whatif", "--bandwidth=-1TB/s", "--bf16", "2PF"], "bandwidth: cannot read"),
    (["whatif", "--bf16", "2PF"], "bandwidth: missing"),
    (["whatif", "--bandwidth", "8TB/s"], "peak rate: missing"),
    (["whatif", "--bandwidth", "8TB/s", "--bf16", "lots"], "bf16: cannot read 'lots'"),
    (["explain", "x.py", "--device", "Z9"], "unknown device 'Z9'"),
])
def test_bad_specs_exit_nonzero_naming_the_field(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@no_gpu
def test_calibrate_without_gpu_exits_nonzero(capsys) -> None:
    assert main(["calibrate"]) != 0
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@no_gpu
def test_whatif_validate_without_gpu_exits_nonzero(capsys) -> None:
    assert main(["whatif", "--validate"]) != 0
    assert "needs a GPU" in capsys.readouterr().err


@no_gpu
def test_bench_cli_small_on_cpu(tmp_path, capsys) -> None:
    assert main(["bench", "--suite", "rmsnorm", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| rmsnorm | ok |" in out and "timings need a GPU" in out and list(tmp_path.glob("bench-*.json"))
    assert main(["bench", "--shapes", "full", "--out", str(tmp_path)]) == 2
