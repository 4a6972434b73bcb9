"""Gluon source for a MatmulGroup: the warp-specialized "ping-pong" Hopper GEMM (VARIANT "pingpong"),
with the group's epilogue on the accumulator as in matmul.py.

Why: on Hopper our Triton GEMMs run each tile's epilogue on the warps that issue its MMAs, so the tensor
cores idle through it; Triton 3.6 offers warp specialization on Hopper only through Gluon, its
lower-level dialect. On the H200 this kernel ran gelu_mlp's first GEMM (8192x16384x4096 + bias + tanh-GELU)
at 736 TFLOP/s against 672 for both our best Triton config and cuBLAS + torch's epilogue
(bench/gluon_gemm_gpu.py, results/gluon_gemm_*_20261202_2215.txt). The kernel:

  - one producer warp issues TMA loads of A' and B' tiles into a STAGES-deep ring of shared memory
    (mbarriers: `ready` per stage, completed by the copies' transaction bytes; `empty`, arrived by the
    consumer that read the stage);
  - two consumer warpgroups take alternate output tiles of the program's persistent sequence (tiles
    pid, pid + P, ...: consumer c takes the program's tiles 2j + c); their k-blocks follow one another
    in the ring, and a pair of `turn` barriers hands the ring from one consumer to the other once it has
    taken its tile's last stage, so one consumer's main loop runs while the other runs its epilogue;
  - each consumer holds a [BLOCK_M, BLOCK_N] fp32 accumulator (async wgmma, one group in flight) and
    runs the epilogue in the accumulator's own layout (a bias is loaded as a row slice of it); one
    16-bit output covering the whole [M, N] tile in rows of 16-byte-aligned stride goes out through a
    TMA store staged in that consumer's shared tile, the others through masked pointer stores.

Covered (`pingpong_supported`): 16-bit operands read through TMA descriptors (A' and B' either way
round: a transposed operand is a permuted view of its shared tile), no batch dims (folded batches are
rows), no claimed reductions, an epilogue whose Triton functions Gluon has. The descriptors are made
on the device (one global-scratch allocation, like the Triton TMA path). The generated source runs
only on an sm_90 GPU: Triton's interpreter does not run Gluon, so CPU tests compile it for sm_90.
"""

from __future__ import annotations

import re
from typing import Any

from ..fusion.epilogue import MatmulGroup
from ..fusion.partition import Entry
from ..ir import dtypes
from .matmul import _GemmWriter

PINGPONG_HEADER = (
    "import triton\n"
    "from triton.experimental import gluon\n"
    "from triton.experimental.gluon import language as gl\n"
    "from triton.experimental.gluon.language.extra import libdevice  # noqa: F401\n"
    "from triton.experimental.gluon.language.nvidia.hopper import (\n"
    "    fence_async_shared,\n"
    "    mbarrier,\n"
    "    tma,\n"
    "    warpgroup_mma,\n"
    "    warpgroup_mma_wait,\n"
    ")\n\n\n"
    "@gluon.jit\n"
    "def _fg_sigmoid(x):\n"
    "    return 1.0 / (1.0 + gl.exp(-x))\n\n\n"
)
# The Triton functions an epilogue may use that Gluon also has (same name under gl.); an epilogue
# using any other (tl.rand, a full reduction, ...) gets no ping-pong variant.
GLUON_FUNCTIONS = frozenset({
    "load", "store", "where", "maximum", "minimum", "exp", "exp2", "log", "log2", "sqrt", "sqrt_rn", "rsqrt",
    "sin", "cos", "erf", "floor", "ceil", "abs", "fma", "fdiv", "div_rn", "cdiv", "full", "zeros",
    "float32", "float16", "bfloat16", "float64", "int1", "int8", "int16", "int32", "int64", "uint8",
})
PINGPONG_CONSTS = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "STAGES"]
_TL_NAME = re.compile(r"\btl\.(\w+)")


def gluon_line(line: str) -> str | None:
    """A line of Triton epilogue source as Gluon source (tl.X -> gl.X; tl.sigmoid and tl.math.exp2 by
    their Gluon spellings), or None when it calls something Gluon lacks."""
    line = line.replace("tl.math.exp2(", "tl.exp2(").replace("tl.sigmoid(", "_fg_sigmoid(")
    if any(name not in GLUON_FUNCTIONS for name in _TL_NAME.findall(line)):
        return None
    return _TL_NAME.sub(r"gl.\1", line)


# epilogue ops that make it worth hiding behind the other consumer's main loop even when K is short
ACTIVATION_OPS = frozenset({"exp", "log", "sin", "cos", "tanh", "sigmoid", "gelu", "silu", "softplus", "elu", "erf"})


def epilogue_activation(group: MatmulGroup) -> bool:
    """Does the group's epilogue compute a transcendental function (an activation such as GELU)?"""
    return any(n.op in ACTIVATION_OPS for n in group.epilogue_nodes)


def pingpong_supported(group: MatmulGroup) -> str | None:
    """None when the ping-pong kernel covers the group, else why not."""
    writer = _PingPongWriter(group, "probe")
    return writer.unsupported()


def generate_pingpong(group: MatmulGroup, name: str) -> tuple[str, int] | None:
    """(the ping-pong variant's module source, its kernel named `name`; bytes per element of the output it
    stores through TMA, 0 if none), or None when it does not cover the group."""
    writer = _PingPongWriter(group, name)
    if writer.unsupported() is not None:
        return None
    key = writer.tma_keys[0] if writer.tma_keys else None
    return writer.write(), 0 if key is None else dtypes.itemsize(writer._out_dtype(key))


class _PingPongWriter(_GemmWriter):
    def __init__(self, group: MatmulGroup, name: str) -> None:
        super().__init__(group, name)
        self.tma_keys: list[str] = []      # the outputs stored through TMA descriptors (_tma_outputs)
        self.batch_vars: list[str] = []   # no batch dims (folded ones are rows)
        self.epilogue: list[str] | None = None   # the epilogue in Gluon (unsupported() writes it)

    def unsupported(self) -> str | None:
        mm = self.gemm.matmul
        if mm.inputs[0].dtype not in ("float16", "bfloat16") or mm.inputs[1].dtype != mm.inputs[0].dtype:
            return f"operands {mm.inputs[0].dtype} x {mm.inputs[1].dtype} (the ping-pong kernel takes 16-bit ones)"
        if self.geo.batch:
            return "batch dims that do not fold into M"
        if self.tma is None:
            return "operands not readable through TMA descriptors (strides)"
        if self.reductions:
            return "a claimed reduction in the epilogue"
        if len(self.gemm.epilogue_nodes) < 2:
            # nothing to hide: cuBLAS runs a bias in its own call (gelu_mlp's second GEMM: 1427 us against
            # the ping-pong kernel's 1467, bench/gluon_gemm_gpu.py --no-gelu)
            return "an epilogue of at most one op (a bias)"
        self.epilogue = self._epilogue_lines()
        if self.epilogue is None:
            return "an epilogue function Gluon lacks"
        return None

    # ---- the epilogue, in Gluon ------------------------------------------------------------------

    def _tma_outputs(self) -> list[str]:
        """The keys of the outputs stored through TMA descriptors: the whole-tile stores of the first 16-bit
        one's dtype. They take turns in the consumer's one staging tile (each store waits until the last one
        has left it); the others are pointer stores from the accumulator's layout, which cost registers
        (an address per element pair: the pointer-store kernel of tests/test_matmul_pingpong.py spills)."""
        by_key = {e.key: e.node for e in self.group.stores}
        keys = [key for key in self.tma_stores if dtypes.itemsize(by_key[key].dtype) == 2]
        return [key for key in keys if by_key[key].dtype == by_key[keys[0]].dtype]

    def store(self, entry: Entry, mask: str, dimvar: dict[int, str], indent: int) -> None:
        if entry.key not in self.tma_keys:
            super().store(entry, mask, dimvar, indent)
            return
        out = self.out_ptr[entry.key]
        value = f"({self.expr[entry.key]}).to({out}.dtype.element_ty)"
        e = self.emit
        e("tma.store_wait(0)   # this consumer's previous tile has left c_smem", indent)
        e(f"c_smem.store({value})", indent)
        e("fence_async_shared()", indent)
        e(f"tma.async_copy_shared_to_global({out}_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)", indent)

    def _epilogue_lines(self, indent: int = 3) -> list[str] | None:
        """The epilogue body (matmul.py's writer, TMA stores of `tma_keys`) as Gluon lines; None if any line
        uses a function Gluon lacks."""
        self.tma_keys = self._tma_outputs()
        start = len(self.lines)
        self._epilogue_body(indent)
        body = self.lines[start:]
        del self.lines[start:]
        out = [gluon_line(line) for line in body]
        if any(line is None for line in out):
            return None
        return [line for line in out if line is not None]

    # ---- the kernel --------------------------------------------------------------------------------

    def write(self) -> str:
        """The module source; after unsupported() returned None."""
        geo, name = self.geo, self.name
        (a_shape, a_strides, a_block, _, a_trans), (b_shape, b_strides, b_block, _, b_trans) = self.tma  # type: ignore[misc]
        pa, pb = (self.ptr[x.id] for x in self.gemm.matmul.inputs)
        epilogue = self.epilogue
        assert epilogue is not None, "write() after unsupported() returned None"
        tma_outs = [self.out_ptr[key] for key in self.tma_keys]
        descs = ", ".join(f"out_desc{i}" for i in range(max(1, len(tma_outs))))
        pointers = self._pointers()
        ptr_list = ", ".join(pointers)
        sizes = f"M, N, K = {geo.m}, {geo.n}, {geo.k}"
        dtype = "gl.bfloat16" if self.gemm.matmul.inputs[0].dtype == "bfloat16" else "gl.float16"
        a_at = "[kk * BLOCK_K, pid_m * BLOCK_M]" if a_trans else "[pid_m * BLOCK_M, kk * BLOCK_K]"
        b_at = "[pid_n * BLOCK_N, kk * BLOCK_K]" if b_trans else "[kk * BLOCK_K, pid_n * BLOCK_N]"
        a_op = "a_bufs.index(s).permute((1, 0))" if a_trans else "a_bufs.index(s)"
        b_op = "b_bufs.index(s).permute((1, 0))" if b_trans else "b_bufs.index(s)"
        consts = ", ".join(f"{c}: gl.constexpr" for c in PINGPONG_CONSTS)
        L: list[str] = []
        add = L.append
        # grouped tile order (GROUP_M rows of tiles share B' columns in L2), as the Triton kernels
        add(f"@gluon.jit\ndef {name}_tile(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):")
        add("    group_size = GROUP_M * num_pid_n")
        add("    first_m = (t // group_size) * GROUP_M")
        add("    rows_in_group = gl.minimum(num_pid_m - first_m, GROUP_M)")
        add("    return first_m + (t % group_size) % rows_in_group, (t % group_size) // rows_in_group\n\n")
        # the producer warp
        add(f"@gluon.jit\ndef {name}_load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, {consts}):")
        add(f"    {sizes}")
        add("    num_pid_m = gl.cdiv(M, BLOCK_M)")
        add("    num_pid_n = gl.cdiv(N, BLOCK_N)")
        add("    k_tiles = gl.cdiv(K, BLOCK_K)")
        add("    p = 0   # position in the ring over the program's whole k-block sequence")
        add("    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):")
        add(f"        pid_m, pid_n = {name}_tile(tile, num_pid_m, num_pid_n, GROUP_M)")
        add("        for kk in range(k_tiles):")
        add("            s = p % STAGES")
        add("            # free once its consumer arrived on `empty` (first pass: parity 1 counts as complete)")
        add("            mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)")
        add("            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)")
        add(f"            tma.async_copy_global_to_shared(a_desc, {a_at}, ready.index(s), a_bufs.index(s))")
        add(f"            tma.async_copy_global_to_shared(b_desc, {b_at}, ready.index(s), b_bufs.index(s))")
        add("            p += 1\n\n")
        # a consumer warpgroup: main loop, then the epilogue while the other consumer's main loop runs
        add(f"@gluon.jit\ndef {name}_mma({ptr_list}, {descs}, a_bufs, b_bufs, ready, empty, turn, c_smem, "
            f"WHICH: gl.constexpr, {consts}):")
        for i, out in enumerate(tma_outs):
            add(f"    {out}_desc = out_desc{i}")
        add(f"    {sizes}")
        add("    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
            "instr_shape=[16, BLOCK_N, 16])")
        add("    num_pid_m = gl.cdiv(M, BLOCK_M)")
        add("    num_pid_n = gl.cdiv(N, BLOCK_N)")
        add("    k_tiles = gl.cdiv(K, BLOCK_K)")
        add("    pid = gl.program_id(0)")
        add("    programs = gl.num_programs(0)")
        add("    for tile in range(pid, num_pid_m * num_pid_n, programs):")
        add("        j = (tile - pid) // programs   # this consumer takes the tiles j = WHICH, WHICH + 2, ...")
        add("        if j % 2 == WHICH:")
        add(f"            pid_m, pid_n = {name}_tile(tile, num_pid_m, num_pid_n, GROUP_M)")
        add("            base = j * k_tiles")
        add("            # our turn once the other consumer has taken all its previous tile's stages (a parity wait")
        add("            # is only right one phase behind; consumer 0's first wait passes: parity 1 at init)")
        add("            mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))")
        add("            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)")
        add("            for kk in range(k_tiles):")
        add("                p = base + kk")
        add("                s = p % STAGES")
        add("                mbarrier.wait(ready.index(s), (p // STAGES) & 1)")
        add(f"                acc = warpgroup_mma({a_op}, {b_op}, acc, is_async=True)")
        add("                # one wgmma group in flight: the previous one has finished reading its stage")
        add("                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])")
        add("                if kk > 0:")
        add("                    mbarrier.arrive(empty.index((p - 1) % STAGES), count=1)")
        add("            mbarrier.arrive(turn.index(1 - WHICH), count=1)   # the other consumer's main loop may start")
        add("            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])")
        add("            mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES), count=1)")
        add("            offs_m = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, "
            "layout=gl.SliceLayout(1, acc_layout)), 1)")
        add("            offs_n = gl.expand_dims(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, "
            "layout=gl.SliceLayout(0, acc_layout)), 0)")
        add("            mask_m = offs_m < M")
        add("            mask_n = offs_n < N")
        add("            mask = mask_m & mask_n")
        add("            zero_m = offs_m * 0")
        add("            zero_mn = zero_m + offs_n * 0")
        L.extend(epilogue)
        add("    tma.store_wait(0)\n\n")
        pass_consts = ", ".join(PINGPONG_CONSTS)
        # the kernel: descriptors, shared memory, barriers, then the three partitions
        add(f"@gluon.jit\ndef {name}({ptr_list}, {consts}):")
        add(f"    {sizes}")
        add("    # 128-byte swizzled tiles: a 64-element (128-byte) inner dim of 16-bit values")
        add("    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)")
        add(f"    a_desc = tma.make_tensor_descriptor({pa}, shape={a_shape}, strides={a_strides}, "
            f"block_shape={a_block}, layout=smem)")
        add(f"    b_desc = tma.make_tensor_descriptor({pb}, shape={b_shape}, strides={b_strides}, "
            f"block_shape={b_block}, layout=smem)")
        a_dims = "[STAGES, BLOCK_K, BLOCK_M]" if a_trans else "[STAGES, BLOCK_M, BLOCK_K]"
        b_dims = "[STAGES, BLOCK_N, BLOCK_K]" if b_trans else "[STAGES, BLOCK_K, BLOCK_N]"
        add(f"    a_bufs = gl.allocate_shared_memory({dtype}, {a_dims}, smem)")
        add(f"    b_bufs = gl.allocate_shared_memory({dtype}, {b_dims}, smem)")
        if tma_outs:
            out_dtype = "gl.bfloat16" if self._out_dtype(self.tma_keys[0]) == "bfloat16" else "gl.float16"
            for i, (key, out) in enumerate(zip(self.tma_keys, tma_outs, strict=True)):
                add(f"    out_desc{i} = tma.make_tensor_descriptor({out}, shape=[M, N], "
                    f"strides=[{self.tma_stores[key]}, 1], block_shape=[BLOCK_M, BLOCK_N], layout=smem)")
            add(f"    c_smem0 = gl.allocate_shared_memory({out_dtype}, [BLOCK_M, BLOCK_N], smem)")
            add(f"    c_smem1 = gl.allocate_shared_memory({out_dtype}, [BLOCK_M, BLOCK_N], smem)")
        else:   # no TMA-stored output: placeholders the partitions never touch
            add("    out_desc0 = a_desc")
            add("    c_smem0 = a_bufs")
            add("    c_smem1 = a_bufs")
        add("    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())")
        add("    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())")
        add("    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())")
        add("    for i in gl.static_range(STAGES):")
        add("        mbarrier.init(ready.index(i), count=1)")
        add("        mbarrier.init(empty.index(i), count=1)")
        add("    for i in gl.static_range(2):")
        add("        mbarrier.init(turn.index(i), count=1)")
        # the partitions: both consumers run one function, WHICH (a constexpr) written into each tuple (a tuple
        # of constexprs assigned to a variable reached the partitions as tensors wrapped in constexprs, which
        # shapes reject: every tuple is written out)
        mma_args = f"{ptr_list}, {descs}, a_bufs, b_bufs, ready, empty, turn"
        add("    gl.warp_specialize([")
        add(f"        ({name}_mma, ({mma_args}, c_smem0, 0, {pass_consts})),")
        add(f"        ({name}_mma, ({mma_args}, c_smem1, 1, {pass_consts})),")
        add(f"        ({name}_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, {pass_consts})),")
        add(f"    ], [4, 1], [{PINGPONG_CONSUMER_REGS}, {PINGPONG_PRODUCER_REGS}])")
        return PINGPONG_HEADER + "\n".join(L) + "\n"

    def _out_dtype(self, key: str) -> str:
        return next(str(e.node.dtype) for e in self.group.stores if e.key == key)


# Registers: the launch caps the whole program at PINGPONG_MAXNREG a thread (12 warps: the default
# partition's 4, the second consumer's 4, the producer's warp rounded up to a warpgroup; 65536 / 384 =
# 170), then setmaxnreg moves them: the second consumer up to PINGPONG_CONSUMER_REGS, the producer down to
# PINGPONG_PRODUCER_REGS. ptxas on the sm_90 compile: no spills (bench/RESULTS.md, twenty-sixth session).
PINGPONG_MAXNREG = 168
PINGPONG_CONSUMER_REGS = 232
PINGPONG_PRODUCER_REGS = 40


def compile_for_sm90(source: str, name: str, pointer_types: list[str], constexprs: dict[str, int]) -> dict[str, Any]:
    """Compile a generated ping-pong kernel for sm_90 without a GPU (Triton's compiler and ptxas run on the
    CPU; not under TRITON_INTERPRET) and count what its PTX holds. `pointer_types`: Triton's names of the
    pointer arguments in order ("*bf16", "*fp32", ...). For CPU tests of the generated source."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .compile import load_triton_function

    fn = load_triton_function(source, name)
    signature = dict(zip(fn.arg_names, [*pointer_types, *("constexpr" for _ in constexprs)], strict=True))
    # pointers 16-byte aligned, as Triton's JIT specializes them at a launch from torch's allocator
    attrs = {(k,): [["tt.divisibility", 16]] for k in range(len(pointer_types))}
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": PINGPONG_MAXNREG})
    ptx = compiled.asm["ptx"]
    ops = [ln.split()[0] for ln in (ln.strip().removeprefix("@").partition(" ")[2] if ln.strip().startswith("@")
                                    else ln.strip() for ln in ptx.splitlines()) if ln]
    return {**_ptxas_report(ptx), "shared": int(compiled.metadata.shared),
            "wgmma": sum(op.startswith("wgmma.mma_async") for op in ops),
            "tma_loads": sum(op.startswith("cp.async.bulk.tensor") and ".shared::cluster.global" in op for op in ops),
            "tma_stores": sum(op.startswith("cp.async.bulk.tensor") and ".global.shared::cta" in op for op in ops),
            "setmaxnreg": sum(op.startswith("setmaxnreg") for op in ops),
            "global_loads": {op: ops.count(op) for op in set(ops) if op.startswith("ld.global")},
            "global_stores": {op: ops.count(op) for op in set(ops) if op.startswith("st.global")}}


def _ptxas_report(ptx: str) -> dict[str, Any]:
    """What Triton's own ptxas says of `ptx` for sm_90a under PINGPONG_MAXNREG: spilled bytes and whether
    it serialized the wgmma (warning C7514: non-wgmma instructions read accumulator registers inside a
    pipeline stage). Empty when that ptxas is not found."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f"--maxrregcount={PINGPONG_MAXNREG}", path,
                               "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, timeout=600)
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr))
    return {"spill_bytes": spilled, "wgmma_serialized": "C7514" in done.stderr}
