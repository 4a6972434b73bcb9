"""Our Triton implicit-GEMM convolution (conv2d forward, groups == 1), an autotuned candidate of a
ConvGroup next to cuDNN (backends/conv_kernel.py library_candidates).

GEMM view of conv2d(x[N, C, H, W], w[CO, C, KH, KW]): M = N*OH*OW output pixels (rows), N = CO
output channels (columns), K = KH*KW*C (the reduction), with k -> (kh, kw, c), c fastest. With
channels-last operands w[co, kh, kw, c] is contiguous in that K order, and for one kh the (kw, c)
run of an input window is contiguous in NHWC memory, so the A tile is a gather of mostly adjacent
elements (masked at the padding border and the K tail) and the B tile a plain load. The kernel
takes every tensor's strides, so any layout is correct (NHWC is the fast one), accumulates in
fp32 with tl.dot (fp32 operands: exact, input_precision="ieee", unless TF32 is allowed), adds the
bias in fp32 and stores in the output's dtype into the given output strides. Programs walk the
tiles in grouped (swizzled) order: GROUP_M row tiles share their weight columns in L2.

Two variants, both tuning candidates (config key VARIANT; the autotuner checks each config against
F.conv2d and times it, and the faster wins per problem): "direct" gathers A from x itself as above;
"padded" (triton_conv_pad.py) first writes x into a zero-padded NHWC buffer with C padded to a power
of two and w into the matching K order (one extra launch), then gathers each window's kh row as
contiguous, aligned runs without border masks (alignment and contiguity hints: cp.async vectors
instead of one 2-byte load per element when C_in = 3). Without a GPU or autotuning the first
(direct) config runs.

A fourth variant, "s2d" (space-to-depth), serves strided convolutions (stride 2 or 4, e.g. a 7x7/2
stem or a 3x3/2 one): its operand pass (the padded variant's kernel with S2D > 1) writes the
zero-padded input regrouped into stride x stride blocks, x_s2d[n, i, j, (bh, bw, c)] =
x_pad[n, i*s + bh, j*s + bw, c] (C_in rounded up to a power of two), and the weight in the matching
order, w_s2d[co, kh_s, kw_s, (bh, bw, c)] = w[co, c, kh_s*s + bh, kw_s*s + bw] (zero past KH, KW).
The convolution is then a stride-1, unpadded one with a ceil(KH/s) x ceil(KW/s) filter over s^2 *
C_in_pad channels (ResNet-50's stem: 4x4 over 16 channels, K = 256 against 147), run by the direct
gather, whose window rows are now runs of KW_s * 16 contiguous elements. On the H200 the stem took
0.2045 ms this way (0.0275 of it the pass) against 0.2895 padded and 0.884 in cuDNN
(bench/results/stem_conv_s2d_tiles_20261201_1716.txt); the tuner keeps the direct variant for a
3x3/2 stem and for 4x4/4 patch embeddings, where s2d loses.
Both operand-pass variants fold a per-channel scale of a fused epilogue (a batchnorm's) into the
weight they write, so the store applies only the shift.

A third variant, "gemm", computes 1x1 unpadded convolutions over channels-last operands (any
stride, any C_in): each output pixel's A row is its input pixel's C_in contiguous channels and
w[co] is a contiguous row, so the kernel is a plain GEMM (M = N*OH*OW, K = C_in) loading both
operands as aligned 16-byte vectors (cp.async when K takes several steps), with the same fused
epilogue. It is a candidate beside the others for narrow 1x1 convolutions. For wide ones it is not
offered: on ResNet-50's ten 1x1 shapes (b128, bf16) it ran at 0.51-1.02x cuDNN on the H200 and
doubled the cold compile (`bench/stem_conv_gpu.py --pointwise`, bench/results/pointwise_conv_*);
configs() still lists it for them, so that benchmark can time it.

Where it is offered (`unsupported`): conv2d, groups == 1, fp16/bf16/fp32, and C_in <= MAX_C_IN
(16). Why narrow input channels: cuDNN's tensor-core convolutions vectorize the channel dimension
per filter tap (C padded to 8 or more per (kh, kw)), so a 3-channel stem wastes most of its K and
runs near CUDA-core speed: ResNet-50's stem (b128, 3->64, 7x7/2, bf16 NHWC) takes 0.88 ms on the
H200 against a 0.05 ms floor, and zero-padding C to 4 or 8 does not help it. Here K = 7*7*3 = 147
is packed once and padded once (to the K tile). For wide C_in cuDNN is near the tensor-core or
memory floor, and every offered candidate costs compiles and timings at build time, so the rule
keeps this kernel to the narrow convolutions it can win. FUSEGRAPH_DEBUG >= 1 prints why a group
does not get it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import InvalidValueError
from ..ir import dtypes
from ..ir.node import Node
from ..ir.registry import get_op
from ..runtime.kernel import in_strides
from ..settings import settings
from . import triton_conv_pad as pad

KERNEL_NAME = "fg_conv2d_implicit_gemm"
MAX_C_IN = 16
DTYPES = ("float16", "bfloat16", "float32")
VARIANTS = ("direct", "padded", "gemm", "s2d")   # config key VARIANT; see the module doc
TUNING_VERSION = 4                # in the tuning key: 2 = configs carry VARIANT, 3 = the gemm variant, 4 = s2d
S2D_STRIDES = (2, 4)              # strides the s2d variant regroups (each a stride x stride block per pixel)
S2D_MAX_CHANNELS = 64             # the widest regrouped pixel: stride^2 * C_in rounded up to a power of two

TRITON_CONV_SOURCE = '''\
import triton
import triton.language as tl


@triton.jit
def fg_conv2d_implicit_gemm(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    scale_ptr, shift_ptr, res_ptr, rscale_ptr,   # fused epilogue: fp32 [CO] vectors, residual[N, CO, OH, OW]
    BATCH, H, W, OH, OW,
    sxn, sxc, sxh, sxw,           # input  x[N, C, H, W] strides (NHWC: sxc == 1)
    swo, swc, swh, sww,           # weight w[CO, C, KH, KW] strides (channels-last: swc == 1)
    son, soc, soh, sow,           # output out[N, CO, OH, OW] strides
    srn, src, srh, srw,           # residual strides
    C_IN: tl.constexpr, C_OUT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    # the padded variant (triton_conv_pad.py): x is x_pad[N, C_PAD, HP, WA] (NHWC, zero border) and w is
    # w_pad[CO, K] (k contiguous, zero-padded); K runs over kh rows of K_ROW elements (kw, c < C_PAD);
    # ROW_ALIGN divides each contiguous run's start in x_pad, A_CONTIG is the run's length
    PADDED: tl.constexpr, C_PAD: tl.constexpr, K_ROW: tl.constexpr, ROW_ALIGN: tl.constexpr,
    A_CONTIG: tl.constexpr,
    # the gemm variant (1x1, no padding, channels contiguous in x and w, every other x stride and w's
    # row stride a multiple of ALIGN elements): A rows are C_IN contiguous elements, a plain GEMM
    GEMM: tl.constexpr, ALIGN: tl.constexpr,
    # the fused epilogue: ACTIVATION(acc * scale + shift + residual * rscale), each part optional
    HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_RSCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,     # "" | "relu" | "gelu" | "gelu_approx_tanh" | "swish"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GEMM view: rows m = (n, oh, ow), columns co, reduction k = (kh, kw, c) with c fastest
    M = BATCH * OH * OW
    K_TOTAL = KH * KW * C_IN
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(C_OUT, BLOCK_N)

    # grouped tile order: GROUP_M row tiles walk the column tiles together (weights stay in L2)
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < C_OUT
    ow = offs_m % OW
    oh = (offs_m // OW) % OH
    nb = (offs_m // (OW * OH)).to(tl.int64)
    w_cols = w_ptr + offs_n.to(tl.int64) * swo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if PADDED:
        # no border masks (x_pad holds the zero border) and no row masks: tail rows re-read row M-1's
        # window and tail columns weight column C_OUT-1 (their stores are masked). A is masked only
        # along K (kw >= KW, kh >= KH), a mask constant over runs of C_PAD (or whole rows), so each
        # tap's C_PAD channels load as one vector; w_pad[C_OUT, K_STEPS * BLOCK_K] loads unmasked.
        K_STEPS = (KH * K_ROW + BLOCK_K - 1) // BLOCK_K
        m_a = tl.minimum(offs_m, M - 1)
        nb_a = (m_a // (OW * OH)).to(tl.int64)
        row_off = nb_a * sxn + ((m_a // OW) % OH * STRIDE_H) * sxh + (m_a % OW * STRIDE_W) * sxw
        w_rows = tl.minimum(offs_n, C_OUT - 1).to(tl.int64) * (K_STEPS * BLOCK_K)
        for kb in range(0, K_STEPS):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            kh = offs_k // K_ROW
            j = offs_k % K_ROW                      # (kw, c) within the kh row
            kw = j // C_PAD
            if DIL_W == 1:
                col = kh * (DIL_H * sxh) + j        # a kh row's KW*C_PAD elements are contiguous in x_pad
            else:
                col = kh * (DIL_H * sxh) + kw * (DIL_W * sxw) + j % C_PAD
            a_offs = row_off[:, None] + col[None, :]
            a_offs = tl.max_contiguous(tl.multiple_of(a_offs, [1, ROW_ALIGN]), [1, A_CONTIG])
            if KW * C_PAD < K_ROW:
                k_ok = tl.max_constancy((kh < KH) & (kw < KW), [C_PAD])
            else:
                k_ok = tl.max_constancy(kh < KH, [A_CONTIG])
            a = tl.load(x_ptr + a_offs, mask=k_ok[None, :], other=0.0)
            b_offs = w_rows[None, :] + offs_k[:, None]
            b = tl.load(w_ptr + tl.max_contiguous(tl.multiple_of(b_offs, [BLOCK_K, 1]), [BLOCK_K, 1]))
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    elif GEMM:
        # 1x1, unpadded: output pixel m reads the C_IN contiguous channels of input pixel
        # (n, oh * STRIDE_H, ow * STRIDE_W) and column co the C_IN contiguous channels of w[co]. No
        # row or column masks (tail rows re-read row M-1 and tail columns column C_OUT-1; their stores
        # are masked), a K mask only when BLOCK_K does not divide C_IN; aligned, contiguous runs
        # (hints) so both operands load as 16-byte vectors (cp.async on sm_90).
        m_a = tl.minimum(offs_m, M - 1)
        nb_a = (m_a // (OW * OH)).to(tl.int64)
        row_off = nb_a * sxn + ((m_a // OW) % OH * STRIDE_H) * sxh + (m_a % OW * STRIDE_W) * sxw
        w_rows = tl.minimum(offs_n, C_OUT - 1).to(tl.int64) * swo
        for k0 in range(0, C_IN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_offs = row_off[:, None] + offs_k[None, :]
            a_offs = tl.max_contiguous(tl.multiple_of(a_offs, [1, ALIGN]), [1, BLOCK_K])
            b_offs = w_rows[None, :] + offs_k[:, None]
            b_offs = tl.max_contiguous(tl.multiple_of(b_offs, [ALIGN, 1]), [BLOCK_K, 1])
            if C_IN % BLOCK_K == 0:
                a = tl.load(x_ptr + a_offs)
                b = tl.load(w_ptr + b_offs)
            else:
                k_ok = offs_k < C_IN
                a = tl.load(x_ptr + a_offs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptr + b_offs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    else:
        ih0 = oh * STRIDE_H - PAD_H            # top-left input pixel of each output pixel's window
        iw0 = ow * STRIDE_W - PAD_W
        x_rows = x_ptr + nb * sxn + ih0 * sxh + iw0 * sxw
        for k0 in range(0, K_TOTAL, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K_TOTAL
            c = offs_k % C_IN
            kw = (offs_k // C_IN) % KW
            kh = offs_k // (C_IN * KW)
            dh = kh * DIL_H
            dw = kw * DIL_W
            a_ok = m_ok[:, None] & k_ok[None, :]
            if PAD_H > 0:   # without padding every window row lies inside the input (the output size says so)
                ih = ih0[:, None] + dh[None, :]
                a_ok = a_ok & (ih >= 0) & (ih < H)
            if PAD_W > 0:
                iw = iw0[:, None] + dw[None, :]
                a_ok = a_ok & (iw >= 0) & (iw < W)
            a = tl.load(x_rows[:, None] + (c * sxc + dh * sxh + dw * sxw)[None, :], mask=a_ok, other=0.0)
            b = tl.load(w_cols[None, :] + (c * swc + kh * swh + kw * sww)[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=1.0)[None, :]
    if HAS_SHIFT:
        acc += tl.load(shift_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_RESIDUAL:
        res_rows = res_ptr + nb * srn + oh * srh + ow * srw
        res = tl.load(res_rows[:, None] + offs_n.to(tl.int64)[None, :] * src,
                      mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if HAS_RSCALE:
            res = res * tl.load(rscale_ptr + offs_n, mask=n_ok, other=1.0)[None, :]
        acc += res
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "swish":
        acc = acc * tl.sigmoid(acc)
    elif ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "gelu_approx_tanh":
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * inner)     # 0.5 * (1 + tanh(u)) == sigmoid(2u)
    out_rows = out_ptr + nb * son + oh * soh + ow * sow
    out_ptrs = out_rows[:, None] + offs_n.to(tl.int64)[None, :] * soc
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
'''

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), best guess first; clamped to the problem.
# Each candidate is a compile at build time (about 1.8 s of a CPU under a busy compile pool), so the
# lists keep the tiles that won or came within a few percent on the H200: the cold compiles of ConvNeXt-
# nano's 4x4/4 patch embedding, MobileNetV3's stem and first narrow 1x1, and ResNet-50's 7x7/2 stem
# (bench/warm_compile_gpu.py --workload zoo:<model> --choices, results/choices_zoo_*_20261202_1410.txt:
# 26, 19, 17 and 24 candidates before). The padded variant won none of those (s2d beats it on the
# strides s2d regroups); it keeps its earlier winners for the strides s2d does not take.
_PADDED_TILES = ((128, 64, 32, 4, 3), (256, 64, 64, 8, 3), (256, 64, 32, 8, 3), (128, 64, 16, 4, 4))
_TILES = (
    (128, 64, 32, 4, 3), (128, 64, 16, 4, 4), (256, 64, 32, 8, 3), (128, 128, 32, 8, 3),
    (64, 64, 32, 4, 4), (128, 64, 64, 4, 3), (256, 64, 64, 8, 3), (64, 32, 16, 2, 4),
)
# the gemm variant (1x1 convolutions of any width): Hopper GEMM tiles; with C_IN <= 64 the K loop is
# one step, so these are mostly store-bound streaming tiles
_GEMM_TILES = (
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    (128, 128, 32, 4, 4),
)
# the s2d variant: the direct gather over 16 to 64 contiguous channels (ResNet-50's stem regrouped:
# 128x64x64 w4 s3 took 0.180 ms on the H200, bench/results/stem_conv_s2d_*)
_S2D_TILES = ((128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 32, 4, 4))
GROUP_M = 8


def debug(name: str, why: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {name}: Triton conv not used: {why}")


def source_digest() -> str:
    return hashlib.sha256((TRITON_CONV_SOURCE + pad.PAD_SOURCE).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ConvProblem:
    """One convolution: logical NCHW shapes, every operand's strides, dtype and attributes."""
    x_shape: tuple[int, int, int, int]
    w_shape: tuple[int, int, int, int]
    out_shape: tuple[int, int, int, int]
    x_strides: tuple[int, ...]
    w_strides: tuple[int, ...]
    out_strides: tuple[int, ...]
    dtype: str
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    has_bias: bool
    tf32: bool = False

    @property
    def m(self) -> int:
        return self.out_shape[0] * self.out_shape[2] * self.out_shape[3]

    @property
    def k(self) -> int:
        return self.w_shape[1] * self.w_shape[2] * self.w_shape[3]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.out_shape[1] * self.k

    def key(self, device: str) -> dict[str, Any]:
        """The tuning key: the kernel source, shapes, strides, dtype, conv attributes, device, versions."""
        import triton
        return {"version": TUNING_VERSION, "source": source_digest(), "x": [self.x_shape, self.x_strides],
                "w": [self.w_shape, self.w_strides],
                "out": [self.out_shape, self.out_strides], "dtype": self.dtype,
                "conv": [self.stride, self.padding, self.dilation], "bias": self.has_bias, "tf32": self.tf32,
                "device": device, "torch": torch.__version__, "triton": triton.__version__}


def problem_of(node: Node, out_strides: Sequence[int], tf32: bool = False) -> ConvProblem:
    """The ConvProblem of a conv2d node whose operands arrive in their specs' memory strides."""
    stride, padding, dilation, _ = get_op(node.op).extra["params"](node.attrs)
    x, w = node.inputs[0].spec, node.inputs[1].spec
    return ConvProblem(_four(x.shape), _four(w.shape), _four(node.shape), tuple(x.memory_strides),
                       tuple(w.memory_strides), tuple(out_strides), node.dtype, tuple(stride), tuple(padding),
                       tuple(dilation), len(node.inputs) == 3, tf32 and node.dtype == "float32")


def _four(shape: Sequence[int]) -> tuple[int, int, int, int]:
    a, b, c, d = shape
    return (int(a), int(b), int(c), int(d))


def problem_of_tensors(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                       padding: Sequence[int], dilation: Sequence[int], out_strides: Sequence[int] | None = None,
                       tf32: bool = False) -> ConvProblem:
    """The ConvProblem of F.conv2d(x, w, bias, ...) on these tensors (output NHWC-dense by default)."""
    n, c, h, wd = x.shape
    co, _, kh, kw = w.shape
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    dense = out_strides or (oh * ow * co, 1, ow * co, co)
    return ConvProblem((n, c, h, wd), (co, c, kh, kw), (n, co, oh, ow), tuple(x.stride()), tuple(w.stride()),
                       tuple(dense), dtypes.canonical(x.dtype), (stride[0], stride[1]), (padding[0], padding[1]),
                       (dilation[0], dilation[1]), bias is not None, tf32 and x.dtype == torch.float32)


def unsupported(node: Node) -> str | None:
    """Why our Triton conv is not offered for this node (None when it is; see the module doc)."""
    if node.op != "conv2d":
        return f"op {node.op} (forward conv2d only)"
    _, _, _, groups = get_op(node.op).extra["params"](node.attrs)
    if groups != 1:
        return f"grouped convolution (groups={groups})"
    if node.dtype not in DTYPES:
        return f"dtype {node.dtype} (fp16, bf16 and fp32 only)"
    c_in = node.inputs[1].shape[1]
    if c_in > MAX_C_IN:
        return (f"C_in={c_in} > {MAX_C_IN}: cuDNN serves wide input channels (the gemm variant, which "
                f"could run a wide 1x1, measured 0.51-1.02x cuDNN on ResNet-50's 1x1 shapes: not offered)")
    return None


def gemm_unsupported(problem: ConvProblem) -> str | None:
    """Why the gemm variant (a 1x1, unpadded convolution as a plain GEMM over channels-last
    operands) does not apply to this problem (None when it does)."""
    p = problem
    if p.w_shape[2:] != (1, 1):
        return f"kernel {p.w_shape[2]}x{p.w_shape[3]}, not 1x1"
    if p.padding != (0, 0):
        return f"padding {p.padding}"
    if p.x_strides[1] != 1 or p.w_strides[1] != 1:
        return "channels not contiguous in x or w (not channels-last)"
    return None


def gemm_align(problem: ConvProblem) -> int:
    """Elements (a power of two, at most 16 bytes' worth) dividing every start of the gemm variant's
    contiguous runs: x's pixel strides and w's row stride."""
    align = 16 // dtypes.itemsize(problem.dtype)
    strides = (problem.x_strides[0], problem.x_strides[2], problem.x_strides[3], problem.w_strides[0])
    while align > 1 and any(s % align for s in strides):
        align //= 2
    return align


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


ConvConfig = dict[str, Any]   # tile sizes, GROUP_M, num_warps, num_stages (int) and VARIANT (str)


def padded_geometry(problem: ConvProblem) -> pad.PaddedGeometry:
    """x_pad's layout and the K rows of the padded variant for this problem (triton_conv_pad.py)."""
    return pad.geometry(problem.x_shape, problem.w_shape[3], problem.padding, dtypes.itemsize(problem.dtype))


def padded_k(problem: ConvProblem) -> int:
    """The padded variant's reduction length: KH rows of K_ROW elements (>= KW*C_PAD)."""
    return problem.w_shape[2] * padded_geometry(problem).k_row


def padded_helps(problem: ConvProblem) -> bool:
    """Is there anything for the padded variant to pad? Without spatial padding and with C_in a power
    of two its buffer is x itself in the same order, and the variant is the direct one plus a copy
    (MobileNetV3's 16-channel 1x1: all its padded candidates lost, results/choices_zoo_*_1410.txt)."""
    c = problem.x_shape[1]
    return tuple(problem.padding) != (0, 0) or c & (c - 1) != 0


def s2d_unsupported(problem: ConvProblem) -> str | None:
    """Why the s2d variant does not apply (None when it does): it regroups a strided convolution's
    padded input into stride x stride blocks (space-to-depth), which makes it a stride-1
    convolution over stride^2 times the channels with a ceil(K/stride) filter; then the direct
    gather reads each window row as one contiguous run of KWs * C_PAD elements instead of C_in-wide
    (3-channel: 6-byte) pieces."""
    p = problem
    if p.stride[0] != p.stride[1] or p.stride[0] not in S2D_STRIDES:
        return f"stride {p.stride} (equal strides of {' or '.join(map(str, S2D_STRIDES))} only)"
    if p.dilation != (1, 1):
        return f"dilation {p.dilation}"
    channels = p.stride[0] ** 2 * _pow2_at_least(p.x_shape[1])
    if channels > S2D_MAX_CHANNELS:
        return f"{channels} regrouped channels > {S2D_MAX_CHANNELS}"
    return None


def s2d_geometry(problem: ConvProblem) -> pad.PaddedGeometry:
    """The s2d variant's buffer layout (triton_conv_pad.s2d_geometry)."""
    return pad.s2d_geometry(problem.x_shape, problem.w_shape, problem.stride[0], problem.out_shape[2:],
                            dtypes.itemsize(problem.dtype))


def s2d_problem(problem: ConvProblem) -> ConvProblem:
    """The stride-1 convolution the s2d variant runs over its regrouped buffer and weight (same output)."""
    g, s = s2d_geometry(problem), problem.stride[0]
    co, _, kh, kw = problem.w_shape
    kh_s, kw_s = -(-kh // s), -(-kw // s)
    w_strides = (kh_s * kw_s * g.c_pad, 1, kw_s * g.c_pad, g.c_pad)   # w_pad[co, (khs, kws, cs)]
    return replace(problem, x_shape=g.shape, x_strides=g.strides, w_shape=(co, g.c_pad, kh_s, kw_s),
                   w_strides=w_strides, stride=(1, 1), padding=(0, 0))


def configs(problem: ConvProblem) -> list[ConvConfig]:
    """Candidate configs, best guess first, clamped to the problem (tl.dot needs tiles of >= 16) and
    deduplicated. Narrow input channels (C_in <= MAX_C_IN): the direct variant's tiles (the untimed
    default is the first), then the padded variant's, then the gemm variant's where it applies; wide
    ones: the gemm variant's only (the others are offered for narrow channels only, see the module
    doc)."""
    cap_m, cap_n = max(16, _pow2_at_least(problem.m)), max(16, _pow2_at_least(problem.out_shape[1]))
    out: list[ConvConfig] = []
    variants: list[tuple[str, tuple[tuple[int, ...], ...], int]] = []
    if problem.x_shape[1] <= MAX_C_IN:
        variants.append(("direct", _TILES, problem.k))
        if padded_helps(problem):
            variants.append(("padded", _PADDED_TILES, padded_k(problem)))
    if problem.x_shape[1] <= MAX_C_IN and s2d_unsupported(problem) is None:
        variants.append(("s2d", _S2D_TILES, s2d_problem(problem).k))
    if gemm_unsupported(problem) is None:
        variants.append(("gemm", _GEMM_TILES, problem.k))
    for variant, tiles, k in variants:
        cap_k = max(16, _pow2_at_least(k))
        for bm, bn, bk, warps, stages in tiles:
            if problem.dtype == "float32" and bk > 32:   # 4-byte tiles: keep shared memory in bounds
                continue
            cfg: ConvConfig = {"VARIANT": variant, "BLOCK_M": min(bm, cap_m), "BLOCK_N": min(bn, cap_n),
                               "BLOCK_K": min(bk, cap_k), "GROUP_M": GROUP_M, "num_warps": warps,
                               "num_stages": stages}
            if cfg not in out:
                out.append(cfg)
    return out


def variant_of(config: ConvConfig) -> str:
    """A config's variant ("direct" when it names none: configs from before the padded variant)."""
    variant = str(config.get("VARIANT", "direct"))
    if variant not in VARIANTS:
        raise InvalidValueError(f"{KERNEL_NAME}: config VARIANT={variant!r}, not one of {', '.join(VARIANTS)}")
    return variant


def load_kernel() -> Any:
    from ..codegen.compile import load_triton_function
    return load_triton_function(TRITON_CONV_SOURCE, KERNEL_NAME)


@dataclass(frozen=True)
class EpilogueForm:
    """What a fused epilogue applies to the accumulator before the store (see the kernel's
    ACTIVATION(acc * scale + shift + residual * rscale)), and the stored dtype."""
    scale: bool = False
    shift: bool = False
    residual_strides: tuple[int, ...] | None = None
    rscale: bool = False
    activation: str = ""
    out_dtype: str | None = None      # None: the operands' dtype


class TritonConv:
    """Our Triton conv for one ConvProblem, one config and optionally a fused epilogue:
    __call__(x, w, bias, vectors, residual) -> the output in the problem's output strides. The
    padded variant (config VARIANT "padded") first writes x into a zero-padded scratch buffer
    (triton_conv_pad.InputPadder, a second launch) and runs the conv on it."""

    def __init__(self, problem: ConvProblem, config: ConvConfig, epilogue: EpilogueForm | None = None) -> None:
        self.problem, self.config, self.epilogue = problem, dict(config), epilogue or EpilogueForm()
        self.variant = variant_of(config)
        self.fn = load_kernel()
        p, e = problem, self.epilogue
        self.out_dtype = dtypes.to_torch(e.out_dtype or p.dtype)
        self.padder: pad.OperandPadder | None = None
        variant_constexprs = {"PADDED": False, "C_PAD": 1, "K_ROW": 1, "ROW_ALIGN": 1, "A_CONTIG": 1,
                              "GEMM": False, "ALIGN": 1}
        # the variants with an operand pass fold a scale into the weight there (the store keeps the shift)
        self.fold_scale = e.scale and self.variant in ("padded", "s2d")
        self.inner = p   # the convolution the kernel computes: for s2d the stride-1 one over the regrouped buffer
        if self.variant == "s2d":
            why = s2d_unsupported(p)
            if why is not None:
                raise InvalidValueError(f"{KERNEL_NAME}: config VARIANT='s2d' for a convolution it does not "
                                        f"apply to: {why}")
            self.inner = s2d_problem(p)
            self.padder = pad.OperandPadder(s2d_geometry(p), p.w_shape, p.padding, config["BLOCK_K"],
                                            self.fold_scale)
        elif self.variant == "padded":
            geom = padded_geometry(p)
            self.padder = pad.OperandPadder(geom, p.w_shape, p.padding, config["BLOCK_K"], self.fold_scale)
            contiguous = min(config["BLOCK_K"], geom.k_row) if p.dilation[1] == 1 else geom.c_pad
            variant_constexprs = {"PADDED": True, "C_PAD": geom.c_pad, "K_ROW": geom.k_row,
                                  "ROW_ALIGN": geom.row_align(p.stride, p.dilation, config["BLOCK_K"]),
                                  "A_CONTIG": contiguous, "GEMM": False, "ALIGN": 1}
        elif self.variant == "gemm":
            why = gemm_unsupported(p)
            if why is not None:
                raise InvalidValueError(f"{KERNEL_NAME}: config VARIANT='gemm' for a convolution it does not "
                                        f"apply to: {why}")
            variant_constexprs = {**variant_constexprs, "GEMM": True, "ALIGN": gemm_align(p)}
        q = self.inner
        self.constexprs = {
            "C_IN": q.x_shape[1], "C_OUT": p.out_shape[1], "KH": q.w_shape[2], "KW": q.w_shape[3],
            "STRIDE_H": q.stride[0], "STRIDE_W": q.stride[1], "PAD_H": q.padding[0], "PAD_W": q.padding[1],
            "DIL_H": q.dilation[0], "DIL_W": q.dilation[1], "HAS_BIAS": p.has_bias,
            "INPUT_PRECISION": "ieee" if p.dtype == "float32" and not p.tf32 else "tf32", **variant_constexprs,
            "HAS_SCALE": e.scale and not self.fold_scale, "HAS_SHIFT": e.shift,
            "HAS_RESIDUAL": e.residual_strides is not None, "HAS_RSCALE": e.rscale, "ACTIVATION": e.activation,
            "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"], "BLOCK_K": config["BLOCK_K"],
            "GROUP_M": config["GROUP_M"]}
        tiles_m = -(-p.m // config["BLOCK_M"])
        tiles_n = -(-p.out_shape[1] // config["BLOCK_N"])
        self.grid = (tiles_m * tiles_n,)
        self.launch_options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}

    def _args(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              vectors: dict[str, torch.Tensor] | None = None, residual: torch.Tensor | None = None) -> list[Any]:
        """The conv launch's arguments; `x` is x_pad for the padded variant."""
        p, v = self.problem, vectors or {}
        res_strides = self.epilogue.residual_strides or (0, 0, 0, 0)
        x_strides = p.x_strides if self.padder is None else self.padder.geom.strides
        return [x, w, bias if bias is not None else w, out, v.get("scale", w), v.get("shift", w),
                residual if residual is not None else w, v.get("rscale", w),
                p.x_shape[0], x.shape[2], x.shape[3], p.out_shape[2], p.out_shape[3],
                *x_strides, *self.inner.w_strides, *p.out_strides, *res_strides]

    def sources(self) -> str:
        """The kernels this config launches, in order (the padded variant: its input pass first)."""
        if self.padder is None:
            return TRITON_CONV_SOURCE
        g = self.padder.geom
        return (f"# ---- {self.variant} variant: operand pass ({pad.PAD_KERNEL_NAME}) into x_pad{list(g.shape)} "
                f"strides {list(g.strides)} ({g.nbytes} bytes of scratch) and w_pad{list(self.padder.w_shape)} "
                f"----\n{pad.PAD_SOURCE}# ---- then the conv on x_pad, w_pad ----\n{TRITON_CONV_SOURCE}")

    def empty_output(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(self.problem.out_shape, self.problem.out_strides, dtype=self.out_dtype,
                                   device=like.device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 vectors: dict[str, torch.Tensor] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`vectors`: the fused epilogue's fp32 [CO] scale/shift/rscale (those its form has)."""
        p = self.problem   # operands in other strides than planned: copied into the planned ones
        if self.padder is None:
            x, w = in_strides(x, p.x_strides), in_strides(w, p.w_strides)
        else:   # its pass reads x and w in any strides
            x, w = self.padder(x, w, (vectors or {}).get("scale") if self.fold_scale else None)
        if residual is not None and self.epilogue.residual_strides is not None:
            residual = in_strides(residual, self.epilogue.residual_strides)
        out = self.empty_output(x)
        self.fn[self.grid](*self._args(x, w, bias, out, vectors, residual), **self.constexprs, **self.launch_options)
        return out

    def warmup_job(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> Any:
        """A call that makes Triton compile this config (and the padded variant's pass) without
        launching it (tune/precompile.py; plain convolutions: the fused form reuses the plain form's
        tuned config)."""
        out = self.empty_output(x)
        padder = self.padder
        xp, wp = (x, w) if padder is None else padder.empty(x, w)

        def job() -> Any:
            if padder is not None:
                padder.warmup(x, w)
            return self.fn.warmup(*self._args(xp, wp, bias, out), grid=self.grid, **self.constexprs,
                                  **self.launch_options)

        return job


def example_operands(problem: ConvProblem, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random operands in the problem's shapes, strides and dtype (for tuning)."""
    dtype = dtypes.to_torch(problem.dtype)

    def make(shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
        t = torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device=device)
        return t.copy_(torch.randn(tuple(shape), device=device, dtype=torch.float32))

    bias = torch.randn(problem.out_shape[1], device=device).to(dtype) if problem.has_bias else None
    return make(problem.x_shape, problem.x_strides), make(problem.w_shape, problem.w_strides), bias


def tuned(problem: ConvProblem, device: str) -> tuple[TritonConv, dict[str, Any]]:
    """Our conv with the config the autotuner picks for this problem on `device` (the first config
    without a GPU, with autotuning off, or when the cost-model floor says launch-bound), and the
    tuning summary (Kernel.tuning's form). Tuned under one name for every plan position: the same
    convolution in another layer or plan finds the choice in the memo or the disk cache."""
    if not device.startswith("cuda"):
        return TritonConv(problem, configs(problem)[0]), {"source": "default", "seconds": 0.0,
                                                          "candidates": len(configs(problem))}
    return autotuned(problem, device)


def autotuned(problem: ConvProblem, device: str, variant: str | None = None) -> tuple[TritonConv, dict[str, Any]]:
    """tuned() on `device`: each config is compiled (in parallel first), checked against F.conv2d
    in fp32 (a config that computes something else, or fails, is not a candidate) and timed.
    `variant`: only that variant's configs (bench/stem_conv_gpu.py compares them)."""
    from ..tune import Config, bench_ms, tune
    from ..tune.autotuner import summary
    from ..tune.precompile import compile_in_parallel
    from .matmul_kernel import check_same

    candidates = [c for c in configs(problem) if variant is None or c["VARIANT"] == variant]
    x, w, bias = example_operands(problem, device)
    expected: list[torch.Tensor] = []

    def bench(config: Config) -> float:
        conv = TritonConv(problem, _plain(config))
        if not expected:
            expected.append(reference_conv(problem, x, w, bias))
        check_same([conv(x, w, bias)], expected, f"{KERNEL_NAME} {config}")
        return bench_ms(lambda: conv(x, w, bias))

    def precompile(kept: Sequence[Config]) -> None:
        compile_in_parallel([TritonConv(problem, _plain(c)).warmup_job(x, w, bias)
                             for c in kept])

    result = tune(KERNEL_NAME, problem.key(device), [Config(c) for c in candidates], bench,
                  floor_ms=floor_ms(problem), precompile=precompile)
    chosen = _plain(result.config)
    return TritonConv(problem, chosen), summary(result, len(candidates))


def warmup_jobs(node: Node, device: str, allow_tf32: bool, seen: set[str]) -> list[Any]:
    """The compile jobs `autotuned` would run for this convolution (every config it would time, the
    remembered choice, or the first config when it would not time), for the plan's precompile batch
    (backends/plan_precompile.py); [] when our conv does not apply or `seen` has this problem."""
    from ..tune import Config
    from ..tune.autotuner import cached_choice, untimed_reason
    from .plan_precompile import first_time

    if unsupported(node) is not None or not device.startswith("cuda") or not settings.use_triton:
        return []
    problem = problem_of(node, node.spec.memory_strides, allow_tf32)
    if not first_time(f"{KERNEL_NAME} {problem.key(device)!r}", seen):
        return []
    candidates = [Config(c) for c in configs(problem)]
    if len(candidates) > 1 and (not settings.autotune or untimed_reason(floor_ms(problem)) is not None):
        candidates = candidates[:1]
    elif len(candidates) > 1:
        known = cached_choice(KERNEL_NAME, problem.key(device), candidates)
        candidates = candidates if known is None else [known]
    x, w, bias = example_operands(problem, device)
    return [TritonConv(problem, _plain(c)).warmup_job(x, w, bias) for c in candidates]


def _plain(config: Any) -> ConvConfig:
    """A tune.Config (or mapping) as a TritonConv config: VARIANT a str, every other knob an int."""
    return {k: str(v) if k == "VARIANT" else int(v) for k, v in config.items()}


def reference_conv(problem: ConvProblem, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.conv2d in fp32 (TF32 only where the problem allows it), in the problem's dtype."""
    import torch.nn.functional as F

    flags = torch.backends.cudnn
    with flags.flags(enabled=flags.enabled, benchmark=flags.benchmark, deterministic=flags.deterministic,
                     allow_tf32=problem.tf32):
        out = F.conv2d(x.float(), w.float(), None if bias is None else bias.float(), stride=problem.stride,
                       padding=problem.padding, dilation=problem.dilation)
    return out.to(x.dtype)


def floor_bytes(problem: ConvProblem, variant: str = "direct") -> int:
    """Bytes a variant must move at least: x, w, out (and bias) once; the padded and s2d variants
    also write their regrouped input once and read it once (their input pass, counted honestly)."""
    itemsize = dtypes.itemsize(problem.dtype)
    numel = sum(a * b * c * d for a, b, c, d in (problem.x_shape, problem.w_shape, problem.out_shape))
    nbytes = itemsize * (numel + (problem.out_shape[1] if problem.has_bias else 0))
    scratch = {"padded": padded_geometry, "s2d": s2d_geometry}.get(variant)
    return nbytes + (2 * scratch(problem).nbytes if scratch is not None else 0)


def floor_ms(problem: ConvProblem, variant: str = "direct") -> float | None:
    """The cost-model floor of this convolution on the datasheet spec (the autotuner skips timing
    under settings.tune_min_floor_us; it gets the direct variant's floor, the lower one). The padded
    variant's floor counts its scratch traffic and its padded K (KH * K_ROW): the tensor-core work it
    issues."""
    try:
        from ..perf.roofline import floor_of, rate_key_of
        from ..tune.autotuner import _datasheet_spec
        k = {"padded": padded_k, "s2d": lambda p: s2d_problem(p).k}.get(variant, lambda p: p.k)(problem)
        flops = 2 * problem.m * problem.out_shape[1] * k
        floor = floor_of(floor_bytes(problem, variant), flops, flops, rate_key_of(problem.dtype), _datasheet_spec())
        return floor.seconds * 1e3
    except Exception:  # a problem the cost model cannot price is simply tuned
        return None


def conv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: Sequence[int] = (1, 1),
           padding: Sequence[int] = (0, 0), dilation: Sequence[int] = (1, 1), *, config: ConvConfig | None = None,
           out_strides: Sequence[int] | None = None, allow_tf32: bool = False) -> torch.Tensor:
    """F.conv2d(x, w, bias, stride, padding, dilation) (groups 1) through our Triton kernel, the output
    NHWC-dense unless `out_strides` is given; `config` (a dict of configs()) or the autotuned one."""
    problem = problem_of_tensors(x, w, bias, stride, padding, dilation, out_strides, allow_tf32)
    conv = TritonConv(problem, config) if config is not None else tuned(problem, str(x.device))[0]
    return conv(x, w, bias)


class ConvGroupLaunch:
    """A ConvGroup's whole launch with our Triton conv: the conv's product, then the group's epilogue
    exactly as conv_kernel's plain path runs it. Tuned on first use (or `prepare`)."""

    def __init__(self, problem: ConvProblem, conv_args: Sequence[int], epilogue: Any,
                 epi_args: Sequence[int | None], device: str, name: str) -> None:
        self.problem, self.conv_args, self.epilogue = problem, list(conv_args), epilogue
        self.epi_args, self.device, self.name = list(epi_args), device, name
        self.conv: TritonConv | None = None
        self.tuning: dict[str, Any] = {}

    def prepare(self) -> TritonConv:
        if self.conv is None:
            self.conv, self.tuning = tuned(self.problem, self.device)
        return self.conv

    def describe(self) -> str:
        conv = self.prepare()
        p = self.problem
        lines = [f"# Triton implicit-GEMM conv2d ({KERNEL_NAME}): x{list(p.x_shape)} w{list(p.w_shape)} "
                 f"stride {p.stride} padding {p.padding} dilation {p.dilation} {p.dtype}"
                 f"{' +bias' if p.has_bias else ''}; config {conv.config}",
                 f"# GEMM M={p.m} N={p.out_shape[1]} K={p.k}"
                 f"{f' (padded: {padded_k(p)})' if conv.padder is not None else ''}; constexprs {conv.constexprs}",
                 conv.sources()]
        if self.epilogue is not None:
            lines.append(f"# ---- epilogue kernel ({self.epilogue.backend}) ----\n{self.epilogue.source}")
        return "\n".join(lines)

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        conv = self.prepare()
        xs = [args[k] for k in self.conv_args]
        product = conv(xs[0], xs[1], xs[2] if len(xs) == 3 else None)
        if self.epilogue is None:
            return [product]
        return list(self.epilogue.launch([product if k is None else args[k] for k in self.epi_args]))


def group_candidates(group: Any, device: str, name: str, epilogue: Any, compute_dtype: str = "float32",
                     allow_tf32: bool = False) -> dict[str, Any]:
    """Our candidates for a ConvGroup where our conv applies on a CUDA device (else {}, the reason
    under FUSEGRAPH_DEBUG): "triton_conv", the conv then `epilogue` (the group's epilogue kernel;
    None when it has none) as the plain path runs it, and, when the epilogue is a CNN inference
    epilogue (backends/cudnn_conv_epilogue.classify: per-channel affine, residual, activation) and the
    group stores only its result, "triton_conv_fused": that epilogue applied in the conv's store."""
    node = group.compute
    why = unsupported(node)
    if why is None and not device.startswith("cuda"):
        why = f"device {device} is not a GPU"
    if why is None and not settings.use_triton:
        why = "Triton kernels are off (settings.use_triton)"
    if why is None and group.epilogue_nodes and epilogue is None:
        why = "the group's epilogue kernel was not given"
    if why is not None:
        debug(name, why)
        return {}
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    conv_args = [positions[i.id] for i in node.inputs]
    epi_args = [None if n.id == node.id else positions[n.id] for n in group.epilogue.inputs] \
        if epilogue is not None else []
    out_strides = node.spec.memory_strides   # the product's layout, as the plain path writes it
    plain = ConvGroupLaunch(problem_of(node, out_strides, allow_tf32), conv_args, epilogue, epi_args, device, name)
    out: dict[str, Any] = {"triton_conv": plain}
    fused = fused_candidate(group, plain, positions, compute_dtype, device, name)
    if fused is not None:
        out["triton_conv_fused"] = fused
    return out


def fused_candidate(group: Any, plain: ConvGroupLaunch, positions: dict[int, int], compute_dtype: str,
                    device: str, name: str) -> FusedGroupLaunch | None:
    from . import cudnn_conv_epilogue as cce

    if not group.epilogue_nodes:
        return None   # conv (+ bias) alone: the plain candidate is already everything
    final = group.epilogue_nodes[-1]
    if not (len(group.outputs) == 1 and group.outputs[0].id == final.id):
        debug(name, "fused epilogue: the group stores more than its final value")
        return None
    try:
        epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    except cce.NotServed as err:
        debug(name, f"fused epilogue: {err}")
        return None
    return FusedGroupLaunch(epi, plain, positions, tuple(group.outputs[0].spec.memory_strides), compute_dtype,
                            device)


class FusedGroupLaunch:
    """A ConvGroup's launch as ONE kernel: our conv with the group's CNN inference epilogue
    (activation(scale * conv + shift + rscale * residual), backends/cudnn_conv_epilogue.ConvEpilogue)
    applied in its store. The per-channel vectors are folded per call by cudnn_conv_epilogue.fold and
    reused while their inputs are unchanged (its rule); a conv bias that is the whole shift (scale 1)
    is read directly instead. The tile config is the plain candidate's tuned one."""

    def __init__(self, epi: Any, plain: ConvGroupLaunch, positions: dict[int, int], out_strides: tuple[int, ...],
                 compute_dtype: str, device: str) -> None:
        from . import cudnn_conv_epilogue as cce

        conv = epi.conv
        self.epi, self.plain, self.compute_dtype, self.device = epi, plain, compute_dtype, device
        self.conv_at = [positions[i.id] for i in conv.inputs[:2]]
        bias = conv.inputs[2] if len(conv.inputs) == 3 else None
        self.direct_bias = (epi.scale is None and epi.residual_scale is None and bias is not None
                            and epi.shift == ("leaf", bias.id))
        self.bias_at = positions[bias.id] if self.direct_bias and bias is not None else None
        self.fold = not self.direct_bias and (epi.scale, epi.shift, epi.residual_scale) != (None, None, None)
        self.leaf_at = [positions[n.id] for n in epi.leaves]
        self.residual_at = positions[epi.residual.id] if epi.residual is not None else None
        self.cacheable = all(n.op in ("input", "constant") for n in epi.leaves)
        self.constants: dict[int, torch.Tensor] | None = None
        self.folded = cce.FoldedVectors(self.cacheable, self._fold)
        residual = None if epi.residual is None else tuple(epi.residual.spec.memory_strides)
        self.form = EpilogueForm(scale=self.fold and epi.scale is not None, shift=self.fold and epi.shift is not None,
                                 residual_strides=residual, rscale=self.fold and epi.residual_scale is not None,
                                 activation=epi.activation, out_dtype=epi.out.dtype)
        self.problem = replace(plain.problem, out_strides=tuple(out_strides), has_bias=self.direct_bias)
        self.conv: TritonConv | None = None

    def prepare(self) -> TritonConv:
        if self.conv is None:
            self.conv = TritonConv(self.problem, self.plain.prepare().config, self.form)
        return self.conv

    def vectors(self, args: Sequence[torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The folded fp32 per-channel vectors (None: nothing to fold), by cudnn_conv_epilogue's rule
        (FoldedVectors: cached while their inputs are the same memory, unchanged; baked into
        fusegraph's own CUDA-graph captures with a pre-replay refold hook)."""
        if not self.fold:
            return None
        return self.folded.get([args[k] for k in self.leaf_at], args[self.conv_at[0]].device)

    def _fold(self, leaves: Sequence[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        from . import cudnn_conv_epilogue as cce

        if self.constants is None:   # made once, outside any capture (the first call is the build's check)
            self.constants = cce.constant_values(self.epi, self.compute_dtype, device)
        return {k: v.float().contiguous() for k, v in
                cce.fold(self.epi, leaves, self.compute_dtype, device, self.constants).items()}

    def describe(self) -> str:
        conv = self.prepare()
        return "\n".join([f"# Triton implicit-GEMM conv2d with its epilogue in the store: {self.epi.describe()}; "
                          f"epilogue {self.form}; config {conv.config}", conv.sources()])

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        conv = self.prepare()
        x, w = (args[k] for k in self.conv_at)
        bias = args[self.bias_at] if self.bias_at is not None else None
        residual = args[self.residual_at] if self.residual_at is not None else None
        return [conv(x, w, bias, self.vectors(args), residual)]
