"""Registers, occupancy and bytes in flight of the looped row kernel of a cross-entropy forward over
GPT-2's vocabulary ([8192, 50257] bf16 logits, rows padded to 50304 as pad_saved stores them, or
not with --unpadded), for each chunk shape with and without PREFETCH (codegen/triton_gen._looped:
the next chunk's loads issued at the top of each chunk). No GPU needed: the kernel is compiled for
sm_90a with triton.compile (pointer arguments 16-byte aligned, as Triton's JIT specializes them) and
the bundled ptxas -v reports its registers.

    PYTHONPATH=src python bench/looped_rows_cpu.py [--unpadded]       # without TRITON_INTERPRET

Bytes in flight per SM = programs an SM holds (by registers, at most 2048 threads) x threads x the
bytes of bf16 loads each thread has issued and not consumed (one chunk, or two with PREFETCH). An
H200 needs about 4.8 TB/s x ~1 us / 132 SMs = ~36 KB per SM to stream at full bandwidth. A model,
not a measurement: the GPU decides (the autotuner times both forms).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import fusegraph as fg
from fusegraph.codegen.compile import load_triton_function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unpadded", action="store_true", help="rows of 50257 (odd stride: scalar loads)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    vocab, stride = 50257, 50257 if args.unpadded else 50304
    g = fg.Graph("cross_entropy")
    x = g.tensor((8192, stride), "bfloat16", "logits")
    if stride != vocab:
        x = g.slice(x, 1, 0, vocab)
    g.cross_entropy(g.cast(x, "float32"), g.tensor((8192,), "int64", "target"), reduction="none").set_output()
    (kernel,) = [k for k in g.build(device="cpu").kernels if k.kind == "reduction"]
    fn = load_triton_function(kernel.source, kernel.name)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    print(f"{kernel.name}: [8192, {vocab}] bf16 logits, row stride {stride}")
    for block, warps in ((4096, 8), (2048, 4), (2048, 8)):
        for prefetch in (False, True):
            consts = {"ROWS": 1, "BLOCK_C": block, "SINGLE": False, "STAGES": 1, "PREFETCH": prefetch, "USE_PDL": True}
            sig = {p: "constexpr" if p in consts else "*bf16" if p == "in0" else "*i64" if p == "in1" else "*fp32"
                   for p in fn.arg_names}
            aligned = {(k,): [["tt.divisibility", 16]] for k, p in enumerate(fn.arg_names) if p not in consts}
            compiled = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps})
            ptx = compiled.asm["ptx"]
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "k.ptx"), "w") as f:
                    f.write(ptx)
                run = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                                      os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True)
            regs = int(re.search(r"Used (\d+) registers", run.stdout + run.stderr).group(1))  # type: ignore[union-attr]
            threads = 32 * warps
            programs = min(65536 // (regs * threads), 2048 // threads, 32)
            in_flight = programs * threads * (block * 2 // threads) * (2 if prefetch else 1)
            loads = (ptx.count("ld.global.v4"), len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b16", ptx)))
            print(f"  BLOCK_C {block:5d}, {warps} warps, PREFETCH {prefetch!s:5}: {regs:3d} registers, {programs} "
                  f"programs an SM, ~{in_flight / 1024:4.1f} KB of loads in flight per SM; PTX loads: {loads[0]} "
                  f"16-byte vectors, {loads[1]} scalar 2-byte")


if __name__ == "__main__":
    main()
