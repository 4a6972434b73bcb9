"""Every GEMM group of the GPT-2-124M training step (bench/targets_gpu.py's model, autocast bf16) that gets a
ping-pong variant: its epilogue ops, its outputs (dtype, shape, strides, stored through TMA or pointers), and
what ptxas says of the variant's sm_90 compile (registers spilled, wgmma serialized). A diagnosis aid for
the generated Gluon kernel; each variant's source goes to $OUT/pingpong_<kernel>.py when OUT is set.

    PYTHONPATH=src python bench/pingpong_groups_gpu.py [--sink]   # --sink: settings.sink_shared_reshapes on
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_TRITON_PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int64": "*i64", "int32": "*i32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sink", action="store_true", help="sink_shared_reshapes on (activations in the fc epilogue)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    import targets_gpu as T
    from zoo_models import ensure_torchvision_importable

    import fusegraph as fg
    import fusegraph.backends.matmul_kernel as matmul_kernel
    from fusegraph.codegen import matmul as matmul_codegen
    from fusegraph.codegen.gemm_configs import PINGPONG_TILE
    from fusegraph.codegen.matmul_pingpong import compile_for_sm90
    from fusegraph.settings import override

    ensure_torchvision_importable()
    T.S.device = "cuda"
    seen: dict[str, tuple] = {}
    original = matmul_codegen.generate_gemm

    def spy(group, name):  # type: ignore[no-untyped-def]
        gen = original(group, name)
        if "pingpong" in gen.variants:
            seen.setdefault(gen.variants["pingpong"][1], (group, gen))
        return gen

    matmul_codegen.generate_gemm = spy
    matmul_kernel.generate_gemm = spy  # type: ignore[attr-defined]
    model = T.LMWithLoss(T.gpt2("full")).cuda()
    ids = torch.randint(0, 50257, (args.batch, 1024), device="cuda")
    with override(sink_shared_reshapes=args.sink):
        T.TrainStep(model, fg.compile(model), ids, ids.clone(), torch.bfloat16)()
    out_dir = os.environ.get("OUT")
    bm, bn, bk, group_m, stages = PINGPONG_TILE
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "STAGES": stages}
    for source, (group, gen) in seen.items():
        (kernel,) = gen.variants["pingpong"][0]
        g = gen.geometry
        print(f"== {kernel}: M N K = {g.m} {g.n} {g.k}; epilogue {[n.op for n in group.epilogue_nodes]}")
        for n in gen.outputs:
            print(f"   out {n.name}: {n.dtype}{list(n.shape)} strides {list(n.spec.memory_strides)}")
        types = [_TRITON_PTR[n.dtype] for n in [*gen.inputs, *gen.outputs]]
        report = compile_for_sm90(source, kernel, types, consts)
        print(f"   sm_90: {report}")
        if out_dir:
            with open(os.path.join(out_dir, f"pingpong_{kernel}.py"), "w") as f:
                f.write(source)


if __name__ == "__main__":
    main()
