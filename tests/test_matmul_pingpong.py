"""The warp-specialized ping-pong GEMM (codegen/matmul_pingpong.py, Gluon, Hopper only): which groups it
covers, when the autotuner is offered it, what its generated source holds, that the source compiles for
sm_90 here (Triton's compiler and ptxas run without a GPU; the interpreter does not run Gluon), and, on a
Hopper GPU, that its results match the reference executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.backends.matmul_kernel import GemmLaunch, _pingpong_available
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.gemm_configs import SMEM_BYTES, gemm_candidates, gemm_launch_parameters, pingpong_configs
from fusegraph.codegen.matmul import GemmGeometry, generate_gemm
from fusegraph.codegen.matmul_pingpong import gluon_line, pingpong_supported
from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override

SRC = Path(__file__).resolve().parents[1] / "src"
CONSTS = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "STAGES": 4}


def _linear(m: int, n: int, k: int, *, transpose_a: bool = False, transpose_b: bool = False,
            dtype: str = "bfloat16", act: str | None = "gelu", residual: bool = False, save: bool = False):
    g = fg.Graph(name=f"pp_{m}_{n}_{k}_{int(transpose_a)}{int(transpose_b)}_{act}_{int(residual)}",
                 compute_dtype="float32")
    x = g.tensor((k, m) if transpose_a else (m, k), dtype=dtype, name="x")
    w = g.tensor((n, k) if transpose_b else (k, n), dtype=dtype, name="w")
    b = g.tensor((n,), dtype=dtype, name="b")
    y = g.add(g.matmul(x, w, transpose_a=transpose_a, transpose_b=transpose_b), b)
    if save:   # the pre-activation is an output too (a training forward saves it for the backward)
        y.set_output()
    if act == "gelu":
        y = g.gelu(y, approximate="tanh")
    elif act == "silu":
        y = g.silu(y)
    elif act == "tanh":
        y = g.tanh(y)
    if residual:
        y = g.add(y, g.tensor((m, n), dtype=dtype, name="r"))
    y.set_output()
    return g, y


def _group(g: fg.Graph) -> MatmulGroup:
    plan = g.build(device="cpu")
    (group,) = [i for i in claim_epilogues(partition_graph(plan.graph).items, plan.graph) if isinstance(i, MatmulGroup)]
    return group


def _pingpong(g: fg.Graph, name: str) -> tuple[tuple[str, ...], str]:
    return generate_gemm(_group(g), name).variants["pingpong"]


# ---- coverage --------------------------------------------------------------------------------------

def test_covers_16bit_gemms_through_tma_either_way_round() -> None:
    for ta, tb in ((False, False), (False, True), (True, False), (True, True)):
        g, _ = _linear(256, 384, 192, transpose_a=ta, transpose_b=tb)
        assert pingpong_supported(_group(g)) is None, (ta, tb)


@pytest.mark.parametrize("case, why", [
    ({"dtype": "float32"}, "16-bit"),
    ({"k": 191}, "TMA"),                 # a row stride of 191 x 2 bytes is not 16-byte aligned
    ({"act": None}, "a bias"),           # nothing to hide: cuBLAS adds a bias in its own call
])
def test_does_not_cover(case: dict, why: str) -> None:
    args = {"m": 256, "n": 384, "k": 192, **case}
    g, _ = _linear(args.pop("m"), args.pop("n"), args.pop("k"), **args)
    group = _group(g)
    reason = pingpong_supported(group)
    assert reason is not None and why in reason
    assert "pingpong" not in generate_gemm(group, "uncovered").variants


def test_claimed_amax_is_not_covered() -> None:
    g = fg.Graph(name="pp_amax", compute_dtype="float32")
    x = g.tensor((256, 192), dtype="bfloat16", name="x")
    w = g.tensor((192, 384), dtype="bfloat16", name="w")
    y = g.mul(g.matmul(x, w), 0.5)
    q, _ = g.quantize(y, "int8", scale=g.tensor((), dtype="float32", name="s"))
    q.set_output()
    g.max(g.abs(y)).set_output()
    group = _group(g)
    assert group.reductions and "reduction" in (pingpong_supported(group) or "")


def test_batched_gemm_that_does_not_fold_is_not_covered() -> None:
    g = fg.Graph(name="pp_batched", compute_dtype="float32")
    a = g.tensor((3, 128, 64), dtype="float16", name="a")
    b = g.tensor((3, 64, 128), dtype="float16", name="b")
    g.relu(g.matmul(a, b)).set_output()
    assert "batch" in (pingpong_supported(_group(g)) or "")


def test_gluon_line_translates_or_refuses() -> None:
    assert gluon_line("    v = tl.maximum(tl.load(in2 + offs_n), 0.0).to(tl.float32)") == \
        "    v = gl.maximum(gl.load(in2 + offs_n), 0.0).to(gl.float32)"
    assert gluon_line("v = tl.sigmoid(x) + tl.math.exp2(y)") == "v = _fg_sigmoid(x) + gl.exp2(y)"
    assert gluon_line("v = tl.rand(seed, offs)") is None
    assert gluon_line("v = libdevice.tanh(x)") == "v = libdevice.tanh(x)"


def test_setting_off_generates_no_variant() -> None:
    g, _ = _linear(256, 384, 192)
    with override(gemm_pingpong=False):
        assert "pingpong" not in generate_gemm(_group(g), "off").variants


# ---- candidates ------------------------------------------------------------------------------------

def _geometry(m: int, n: int, k: int, batch: tuple[int, ...] = ()) -> GemmGeometry:
    return GemmGeometry(batch, m, n, k, (k, 1), (n, 1), tuple(m * k for _ in batch), tuple(0 for _ in batch))


def test_offered_to_large_16bit_problems_only() -> None:
    big = _geometry(8192, 16384, 4096)
    config, grouped = pingpong_configs(big, sms=132, store_itemsize=2)
    assert (config["GROUP_M"], grouped["GROUP_M"]) == (8, 16)
    assert config["VARIANT"] == "pingpong" and config["STAGES"] == 4 and config["NUM_PROGRAMS"] == 132
    ring = config["STAGES"] * (128 + 128) * 64 * 2
    assert ring + 2 * 128 * 128 * 2 <= SMEM_BYTES                     # ring + both consumers' store tiles fit
    assert pingpong_configs(_geometry(1024, 1024, 4096), sms=132) == []          # 64 tiles: under two a program
    assert pingpong_configs(big, sms=132, itemsize=4) == []                      # fp32
    assert pingpong_configs(_geometry(8192, 16384, 3072), sms=132) == []         # a short main loop
    fc = _geometry(8192, 3072, 768)                                              # GPT-2's fc layer
    assert pingpong_configs(fc, sms=132) == []                                   # ... with a bias at most
    assert len(pingpong_configs(fc, sms=132, activation=True)) == 2              # ... with its GELU
    assert pingpong_configs(_geometry(8192, 3072, 256), sms=132, activation=True) == []
    a_transposed = GemmGeometry((), 8192, 16384, 4096, (1, 8192), (16384, 1), (), ())
    assert pingpong_configs(a_transposed, sms=132) == []
    assert pingpong_configs(_geometry(8192, 16384, 4096, batch=(2,)), sms=132) == []
    grid, consts, warps, _ = gemm_launch_parameters(big, config)
    assert grid == (132,) and warps == 4 and consts == CONSTS


def test_an_activation_in_the_epilogue_is_flagged_for_the_shorter_k() -> None:
    for act, flagged in (("gelu", True), ("silu", True), (None, False)):
        gen = generate_gemm(_group(_linear(8192, 3072, 768, act=act, residual=act is None)[0]), f"act_{act}")
        assert "pingpong" in gen.variants and gen.pingpong_activation is flagged, act
        offered = gemm_candidates(gen.geometry, tma=True, sms=132, pingpong_store_itemsize=2,
                                  pingpong_activation=gen.pingpong_activation)
        assert any(c.get("VARIANT") == "pingpong" for c in offered) is flagged, act


def test_candidate_lists_hold_it_when_asked_and_never_for_conv_gemms() -> None:
    big = _geometry(8192, 16384, 4096)
    variants = [c.get("VARIANT", "tiled") for c in gemm_candidates(big, tma=True, pingpong_store_itemsize=2)]
    assert variants.count("pingpong") == 2
    assert "pingpong" not in [c.get("VARIANT") for c in gemm_candidates(big, tma=True)]
    conv = gemm_candidates(big, tma=True, pingpong_store_itemsize=2, candidates="conv")
    assert "pingpong" not in [c.get("VARIANT") for c in conv]


def test_not_available_without_a_hopper_gpu() -> None:
    assert not _pingpong_available("cpu")


# ---- the generated source --------------------------------------------------------------------------

def test_source_partitions_and_epilogue() -> None:
    g, _ = _linear(256, 384, 192, transpose_b=True, residual=True)
    (name,), source = _pingpong(g, "src")
    assert name == "src_pingpong"
    assert "gl.warp_specialize([" in source and "], [4, 1], [232, 40])" in source
    assert "b_bufs.index(s).permute((1, 0))" in source and "a_bufs.index(s))" in source
    mma = source.split(f"def {name}_mma(")[1].split("@gluon.jit")[0]
    # bias (a row slice), gelu (via sigmoid), residual (a full-tile load), then the only store: through TMA
    assert mma.count("gl.load(") == 2 and "_fg_sigmoid(" in mma and "gl.store(" not in mma
    assert mma.count("tma.async_copy_shared_to_global(out0_desc") == 1
    assert "tl." not in source


def test_output_rows_not_16_byte_aligned_store_through_pointers() -> None:
    g, _ = _linear(256, 385, 192, transpose_b=True, act="silu")   # 385 x 2 bytes a row
    (name,), source = _pingpong(g, "odd")
    mma = source.split(f"def {name}_mma(")[1].split("@gluon.jit")[0]
    assert "gl.store(out0 + " in mma and "async_copy_shared_to_global" not in mma
    assert "c_smem0 = a_bufs" in source   # no store tiles allocated


def _compile_sm90(cases: list[tuple[str, str, int]]) -> list[dict]:
    """Each (source, kernel name, pointer count) compiled for sm_90 in a process without the interpreter."""
    code = ("import json, sys\nfrom fusegraph.codegen.matmul_pingpong import compile_for_sm90\n"
            "out = []\nfor src, name, n in json.loads(sys.stdin.read()):\n"
            f"    out.append(compile_for_sm90(src, name, ['*bf16'] * n, {CONSTS!r}))\n"
            "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=900)
    if done.returncode != 0 and "CompilationError" not in done.stderr and "Error" not in done.stderr[-300:]:
        pytest.skip(f"cannot compile sm_90 here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_generated_kernels_compile_for_sm90() -> None:
    graphs = [_linear(1024, 1024, 512),                                              # bias + gelu, TMA store
              _linear(1000, 1000, 520, transpose_b=True, act=None, residual=True),  # nn.Linear weight, residual
              _linear(512, 640, 256, transpose_a=True, act="silu"),                  # A' read transposed
              _linear(512, 385, 256, transpose_b=True, act="gelu"),                  # pointer stores
              _linear(1024, 1536, 768, act="tanh", save=True)]                      # two outputs through TMA
    cases = []
    for g, _ in graphs:
        gen = generate_gemm(_group(g), g.name)
        (name,), source = gen.variants["pingpong"]
        cases.append((source, name, len(gen.inputs) + len(gen.outputs)))
    results = _compile_sm90(cases)
    for (g, _), r in zip(graphs, results, strict=True):
        assert r["wgmma"] > 0 and r["tma_loads"] > 0 and r["setmaxnreg"] > 0, (g.name, r)
        assert r["shared"] <= SMEM_BYTES, (g.name, r)
    assert results[0]["tma_stores"] > 0 and not results[0]["global_stores"]
    assert results[0]["shared"] >= 4 * 32768 + 2 * 32768            # the ring and both consumers' store tiles
    assert set(results[1]["global_loads"]) == {"ld.global.b32"}      # residual and bias: pairs of bf16 a load
    assert results[3]["global_stores"] and not results[3]["tma_stores"]
    assert results[4]["tma_stores"] == 2 * results[0]["tma_stores"] and not results[4]["global_stores"]
    # ptxas, outputs through TMA: no spills, the consumers' wgmma not serialized (pointer stores from the
    # accumulator's layout, case 3, need an address per element pair: that one spills)
    for (g, _), r in [(graphs[i], results[i]) for i in (0, 1, 2, 4)]:
        assert r.get("spill_bytes", 0) == 0 and not r.get("wgmma_serialized", False), (g.name, r)


# ---- on a Hopper GPU -------------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(not _pingpong_available("cuda"), reason="needs a Hopper GPU (sm_90) and Gluon")


@needs_hopper
@pytest.mark.parametrize("shape, kw", [
    ((1024, 1536, 512), {}),
    ((1000, 1000, 520), {"transpose_b": True, "act": None, "residual": True}),
    ((2048, 640, 256), {"transpose_a": True, "act": "silu"}),
    ((2048, 2056, 264), {"transpose_b": True}),
    ((640, 385 * 8 + 1, 1024), {"transpose_b": True, "dtype": "float16"}),
    ((1024, 1536, 768), {"act": "tanh", "save": True}),
])
def test_pingpong_matches_the_reference_on_the_gpu(shape: tuple[int, int, int], kw: dict) -> None:
    g, _ = _linear(*shape, **kw)
    gen = generate_gemm(_group(g), f"gpu_{g.name}")
    assert "pingpong" in gen.variants
    feeds = {}
    for node in gen.inputs:
        scale = node.shape[-1] ** -0.5 if node.name in ("x", "w") else 1.0
        feeds[node.name] = (torch.randn(node.shape) * scale).to(getattr(torch, node.dtype))
    config = pingpong_configs(gen.geometry, sms=132, store_itemsize=gen.pingpong_store_itemsize)
    config = config or [{"VARIANT": "pingpong", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                         "STAGES": 4, "NUM_PROGRAMS": 16, "num_warps": 4, "num_stages": 4}]
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config[0], "cuda")
    got = launch([feeds[n.name].cuda() for n in gen.inputs])
    want = {n.name: v for n, v in fg.reference(g).execute({h: feeds[h.name] for h in g.inputs()}).items()}
    assert len(got) == len(gen.outputs) == (2 if kw.get("save") else 1)
    for node, value in zip(gen.outputs, got, strict=True):   # the plan's nodes keep the graph's names
        assert_close(value.cpu(), want[node.name], what=f"ping-pong {g.name} {node.name}")
