"""Horizontal fusion (fusion/horizontal.py, codegen/combo.py): independent elementwise kernels reading
only graph inputs run as one combo kernel; results equal the reference, the rules that keep a kernel
out hold, and the generated source compiles for sm_90."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.fusion import horizontal
from fusegraph.settings import override


def _casts_graph() -> fg.Graph:
    g = fg.Graph("casts", compute_dtype="float32")
    w = g.tensor((64, 192), name="w")
    b = g.tensor((300,), name="b")
    v = g.tensor((5000,), name="v")
    x = g.tensor((8, 64), name="x")
    g.cast(w, "bfloat16").set_output()
    g.cast(b, "float16").set_output()
    g.mul(v, 2.0).set_output()
    g.add(g.exp(x), g.tensor((64,), name="row")).set_output()   # a broadcast load: not a member
    return g


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(64, 192), torch.randn(300), torch.randn(5000), torch.randn(8, 64), torch.randn(64)]


def test_casts_of_inputs_become_one_combo_kernel() -> None:
    g = _casts_graph()
    plan = g.build(device="cpu")
    combos = [k for k in plan.kernels if "combo" in k.name]
    assert len(combos) == 1 and len(combos[0].outputs) == 3
    assert combos[0].config == {"BLOCK": 1024, "num_warps": 4}
    assert sum(k.kind == "pointwise" for k in plan.kernels) == 2   # the combo and the broadcast add
    src = combos[0].source
    assert src.count("if (pid >= ") == 3 and "programs 12..12" in src   # 12288 elements: programs 0..11
    args = _inputs()
    for _ in range(2):
        got = plan(*args)
        want = fg.reference(g)(*args)
        for a, r, what in zip(got, want, ("cast bf16", "cast fp16", "mul", "add"), strict=True):
            assert a.dtype == r.dtype
            assert_close(a, r, what=what)
        args = _inputs()


def test_kernels_left_out_of_a_combo() -> None:
    """A kernel reading an intermediate, a broadcast operand or a transposed input stays alone; with one
    kernel left there is no combo; the setting turns it off."""
    g = fg.Graph("alone", compute_dtype="float32")
    w = g.tensor((64, 32), name="w")
    t = g.tensor((32, 64), name="t")
    g.cast(g.exp(g.matmul(w, t)), "bfloat16").set_output()   # reads the matmul's result
    g.cast(g.transpose(t, 0, 1), "bfloat16").set_output()     # not row-major in the domain's order
    g.cast(w, "bfloat16").set_output()
    plan = g.build(device="cpu")
    assert not any("combo" in k.name for k in plan.kernels)
    with override(horizontal_fusion=False):
        plan = _casts_graph().build(device="cpu")
    assert not any("combo" in k.name for k in plan.kernels)


def test_outputs_brought_forward_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Members run first, so outputs the plan does not return live longer: those join only up to
    COMBO_TEMP_BYTES; returned ones always do."""
    g = fg.Graph("temps", compute_dtype="float32")
    a, b, c = (g.tensor((256, 64), name=n) for n in "abc")
    x = g.tensor((64, 16), name="x")
    g.matmul(g.cast(a, "float16"), g.cast(x, "float16")).set_output()   # 32 KiB cast, not returned
    g.matmul(g.cast(b, "float16"), g.cast(x, "float16")).set_output()   # (fp16: the interpreter's bf16 dot is wrong)
    g.cast(c, "float16").set_output()
    monkeypatch.setattr(horizontal, "COMBO_TEMP_BYTES", 40 << 10)
    plan = g.build(device="cpu")
    combo = [k for k in plan.kernels if "combo" in k.name]
    assert len(combo) == 1
    shapes = sorted(tuple(o.shape) for o in combo[0].outputs)
    assert shapes.count((256, 64)) == 2   # c (returned) and one of a, b (32 KiB of the 40 allowed)
    args = [torch.randn(256, 64) for _ in range(3)] + [torch.randn(64, 16)]
    for got, want in zip(plan(*args), fg.reference(g)(*args), strict=True):
        assert_close(got, want, what="temps")


def test_an_epilogues_casts_of_inputs_join_the_combo() -> None:
    """Two fp32 vectors cast and added in one GEMM epilogue: both casts leave the epilogue for the combo
    (one group each, however the epilogue's entries shift), the GEMM reads the fp16 vectors."""
    g = fg.Graph("epilogue_casts", compute_dtype="float32")
    x = g.tensor((32, 64), dtype="float16", name="x")
    w, b1, b2 = g.tensor((64, 48), name="w"), g.tensor((48,), name="b1"), g.tensor((48,), name="b2")
    y = g.add(g.add(g.matmul(x, g.cast(w, "float16")), g.cast(b1, "float16")), g.cast(b2, "float16"))
    y.set_output()
    g.cast(g.tensor((100,), name="v"), "float16").set_output()
    plan = g.build(device="cpu")
    combo = next(k for k in plan.kernels if "combo" in k.name)
    assert sorted(tuple(o.shape) for o in combo.outputs) == [(48,), (48,), (64, 48), (100,)]
    gemm = next(k for k in plan.kernels if k.kind == "matmul")
    assert gemm.ops == ["matmul", "add", "add"] and [i.dtype for i in gemm.inputs] == ["float16"] * 4
    args = [torch.randn(32, 64).half(), torch.randn(64, 48), torch.randn(48), torch.randn(48), torch.randn(100)]
    for got, want in zip(plan(*args), fg.reference(g)(*args), strict=True):
        assert_close(got, want, what="epilogue casts")


def test_members_split_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(horizontal, "COMBO_MAX_MEMBERS", 2)
    g = fg.Graph("chunks", compute_dtype="float32")
    for k in range(5):
        g.cast(g.tensor((100 + k,), name=f"w{k}"), "bfloat16").set_output()
    plan = g.build(device="cpu")
    assert sorted(len(k.outputs) for k in plan.kernels) == [1, 2, 2]


def test_autocast_mlp_training_casts_its_weights_in_one_kernel() -> None:
    """A training step under fp16 autocast: the forward's weight and bias casts are one combo kernel; the
    loss and every gradient match eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 80),
                                torch.nn.ReLU(), torch.nn.Linear(80, 16))
    ref = copy.deepcopy(model)
    x = torch.randn(48, 64)

    def step(m: torch.nn.Module) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    torch._dynamo.reset()
    compiled = fg.compile(model)
    got, want = step(compiled), step(ref)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, tol=2e-2, what="loss/grad")
    forward = [g for g in compiled.fusegraph_report.graphs if g.kind == "forward"]
    kernels = [k for g in forward for p in g.partitions if p.plan is not None for k in p.plan.kernels]
    combos = [k for k in kernels if "combo" in k.name]
    assert len(combos) == 1
    cast = sorted(tuple(o.shape) for o in combos[0].outputs)
    # the three weights, the three biases (split out of the GEMM epilogues) and the input x, to fp16
    assert {(96, 64), (80, 96), (16, 80), (96,), (80,), (16,)} <= set(cast), cast
    gemms = [k for k in kernels if k.kind == "matmul"]
    assert len(gemms) == 3 and all("cast" not in k.ops for k in gemms)   # each reads its fp16 bias
    torch._dynamo.reset()


_COMPILE = """
import importlib.util, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
spec = importlib.util.spec_from_file_location("combo_src", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, sys.argv[2])
types = dict(arg.split("=") for arg in sys.argv[3:])
sig = {n: "constexpr" if n in ("BLOCK", "USE_PDL") else types[n] for n in fn.arg_names}
compiled = compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": 1024, "USE_PDL": True}),
                   target=GPUTarget("cuda", 90, 32))
print("ok", len(compiled.asm["cubin"]))
"""


def test_combo_source_compiles_for_sm90(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real compiler (not the interpreter) takes the member bodies under their program ranges."""
    pytest.importorskip("triton")
    g = _casts_graph()
    kernel = next(k for k in g.build(device="cpu").kernels if "combo" in k.name)
    path = tmp_path / "combo_src.py"
    path.write_text(kernel.source)
    ptr = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
    types = [f"in{k}={ptr[str(n.dtype)]}" for k, n in enumerate(kernel.inputs)]
    types += [f"out{k}={ptr[str(n.dtype)]}" for k, n in enumerate(kernel.outputs)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE), str(path), kernel.name, *types],
                         capture_output=True, text=True, env=env, timeout=300)
    if "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("no ptxas")
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]
