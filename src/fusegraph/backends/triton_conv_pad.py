"""The operand pass of our Triton implicit-GEMM conv's "padded" and "s2d" variants
(backends/triton_conv.py). The padded layout is described here; the s2d variant's pass is the same
kernel with S2D = stride > 1 (each x_pad pixel holds a stride x stride block of padded pixels, the
weight regrouped to match: triton_conv.s2d_geometry). Either pass can fold a fused epilogue's
per-output-channel scale into the weight it writes (HAS_SCALE).

Why: with C_in = 3 the direct kernel gathers each A element with its own 2-byte load at a 6-byte
aligned address, masked at the padding border, so nothing vectorizes and no load goes through
cp.async (compiled for sm_90: 80 `ld.global.b16` per thread per K loop, no cp.async). The padded
variant first writes its operands into scratch buffers in one small kernel (fg_conv_pad_operands),
then the conv gathers from them without border masks:

- x_pad[N, HP, WA, C_PAD] (NHWC): the input (any strides) with its zero border written out, and
  C_PAD = the next power of two >= C_in (3 -> 4: 8-byte pixels for 2-byte types). 1 stays 1 and 2
  stays 2. A vector is at most one tap (C_PAD elements) wherever the filter's KW*C_PAD falls short
  of K_ROW, because the tap mask (kw < KW) changes there; so with C_in = 1 (and KW not a power of
  two) the padded variant still loads A element by element (compiled for sm_90: ld.global.b16) and
  only drops the border masks. C_PAD = 2 would allow 4-byte loads at twice the K (tensor-core work)
  and twice the scratch bytes; not worth a third variant for grayscale inputs.
- The reduction runs over kh rows of K_ROW = the next power of two >= KW*C_PAD elements
  (k -> (kh, j), j -> (kw, c) = (j // C_PAD, j % C_PAD)): with dilation 1 a window's kh row is
  KW*C_PAD contiguous elements of x_pad.
- w_pad[C_OUT, KP] (k contiguous, KP = KH*K_ROW rounded up to the K tile): the weight in that K
  order, zero for the padded channels, the row tails and the last tile's tail, so the conv loads it
  without any mask (tail columns co >= C_OUT re-read column C_OUT-1; their stores are masked).
- WA = W + 2*PAD_W rounded up so that a padded row's pitch (WA*C_PAD elements) is a multiple of 16
  bytes; the extra columns are zeros and never read.
- ROW_ALIGN (elements, PaddedGeometry.row_align) divides the first element of every contiguous run
  the conv reads from x_pad; the kernel states it with tl.multiple_of and the run length with
  tl.max_contiguous, so each run loads in vectors of min(ROW_ALIGN, run, mask constancy) elements.

Both operands are written by ONE launch (the programs past the input's take the weight), so a call
is two launches: this pass, then the conv. Bytes (floor_bytes in triton_conv.py): the pass reads x
and writes x_pad once, and the conv reads x_pad instead of x. ResNet-50's stem (b128, bf16): x is
38.5 MB, x_pad 128*230*230*4*2 = 54.2 MB, so the pass moves 92.7 MB (~0.02 ms at the H200's
4.8 TB/s) on top of the conv's own traffic; the weight (64*147 -> 64*224 elements) is noise. The
buffers are scratch, allocated per call (torch.empty: the caching allocator reuses them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PAD_KERNEL_NAME = "fg_conv_pad_operands"
PAD_BLOCK = 1024          # elements of x_pad (or w_pad) per program
PAD_WARPS = 4
VECTOR_BYTES = 16         # the widest global load

PAD_SOURCE = '''\
import triton
import triton.language as tl


@triton.jit
def fg_conv_pad_operands(
    x_ptr, xp_ptr, w_ptr, wp_ptr, scale_ptr,
    X_TOTAL, X_PROGRAMS, W_TOTAL, H, W, HP, WA,
    sxn, sxc, sxh, sxw,           # input x[N, C, H, W] strides (any layout)
    swo, swc, swh, sww,           # weight w[CO, C, KH, KW] strides (any layout)
    C_IN: tl.constexpr, C_PAD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, K_ROW: tl.constexpr,
    KP: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    # space-to-depth (the s2d variant): x_pad's channel cs = (bh * S2D + bw) * C_IN_PAD + c holds padded
    # pixel (hp * S2D + bh, wp * S2D + bw); S2D = 1 and C_IN_PAD = C_PAD is the plain padded layout
    S2D: tl.constexpr, C_IN_PAD: tl.constexpr,
    HAS_SCALE: tl.constexpr,      # w_pad[co] = w[co] * scale[co] (fp32 [CO]: a batchnorm's scale folded in)
    INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < X_PROGRAMS and S2D > 1:
        # the s2d layout as [pixels, C_PAD] tiles: a pixel's position and each channel's (bh, bw, c) are
        # worked out once per row and once per column, not per element (per element, the flat form
        # below spent twice the padded pass's instructions on signed divisions: 0.078 against 0.034 ms)
        PIX: tl.constexpr = BLOCK // C_PAD     # (names apart from the other branches': Triton types them jointly)
        pixels = pid * PIX + tl.arange(0, PIX)
        if INDEX_64:
            pixels = pid.to(tl.int64) * PIX + tl.arange(0, PIX)
        lanes = tl.arange(0, C_PAD)
        sub = lanes // C_IN_PAD                # (bh, bw) of each channel of a regrouped pixel
        chan = lanes % C_IN_PAD
        inside = pixels < X_TOTAL // C_PAD
        rows = (((pixels // WA) % HP) * S2D - PAD_H)[:, None] + (sub // S2D)[None, :]
        cols = ((pixels % WA) * S2D - PAD_W)[:, None] + (sub % S2D)[None, :]
        image = pixels // (WA * HP)
        valid = inside[:, None] & (chan < C_IN)[None, :] & (rows >= 0) & (rows < H) & (cols >= 0) & (cols < W)
        got = tl.load(x_ptr + (image * sxn)[:, None] + (chan * sxc)[None, :] + rows * sxh + cols * sxw,
                      mask=valid, other=0.0)
        tl.store(xp_ptr + pixels[:, None] * C_PAD + lanes[None, :], got, mask=inside[:, None])
    elif pid < X_PROGRAMS:
        # x_pad[n, hp, wp, c] = x[n, c, hp - PAD_H, wp - PAD_W] inside the image and c < C_IN, else 0:
        # a flat pass over x_pad (dense NHWC, pixel pitch C_PAD, row pitch WA * C_PAD), contiguous stores
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        if INDEX_64:
            offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_total = offs < X_TOTAL
        c = offs % C_PAD
        pix = offs // C_PAD
        ih = (pix // WA) % HP - PAD_H
        iw = pix % WA - PAD_W
        nb = pix // (WA * HP)
        ok = in_total & (c < C_IN) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        v = tl.load(x_ptr + nb * sxn + c * sxc + ih * sxh + iw * sxw, mask=ok, other=0.0)
        tl.store(xp_ptr + offs, v, mask=in_total)
    else:
        # w_pad[co, k] (k = kh * K_ROW + kw * C_PAD + cs, KP per co) = w[co, c, kh * S2D + bh, kw * S2D + bw]
        # with cs -> (bh, bw, c), 0 past C_IN, KW, KH
        offs = (pid - X_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
        in_total = offs < W_TOTAL
        co = offs // KP
        k = offs % KP
        cs = k % C_PAD
        block = cs // C_IN_PAD
        c = cs % C_IN_PAD
        kh = (k // K_ROW) * S2D + block // S2D
        kw = ((k % K_ROW) // C_PAD) * S2D + block % S2D
        ok = in_total & (kh < KH) & (kw < KW) & (c < C_IN)
        v = tl.load(w_ptr + co * swo + c * swc + kh * swh + kw * sww, mask=ok, other=0.0)
        if HAS_SCALE:
            v = (v.to(tl.float32) * tl.load(scale_ptr + co, mask=in_total, other=1.0)).to(wp_ptr.dtype.element_ty)
        tl.store(wp_ptr + offs, v, mask=in_total)
'''


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_dividing(n: int) -> int:
    return n & -n if n else 1 << 30


@dataclass(frozen=True)
class PaddedGeometry:
    """The padded variant's x_pad layout and K rows for one problem (independent of the tile config);
    with s2d > 1 the s2d variant's space-to-depth layout (see triton_conv.s2d_geometry)."""
    c_pad: int
    k_row: int          # elements of a kh row in K (>= KW * C_PAD, a power of two; s2d: KWs * C_PAD exactly)
    hp: int
    wa: int             # padded width incl. the pitch-rounding columns
    shape: tuple[int, int, int, int]       # x_pad as NCHW-logical [N, C_PAD, HP, WA] (NHWC memory)
    strides: tuple[int, int, int, int]     # (sxn, sxc, sxh, sxw) = (HP*WA*C_PAD, 1, WA*C_PAD, C_PAD)
    itemsize: int
    s2d: int = 1        # space-to-depth factor: x_pad pixel (hp, wp) holds an s2d x s2d block of padded pixels
    c_in_pad: int = 0   # channels per block pixel (C_in rounded up to a power of two); 0: c_pad

    @property
    def c_group(self) -> int:
        return self.c_in_pad or self.c_pad

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def k_pad(self, kh: int, block_k: int) -> int:
        """w_pad's row length: KH rows of K_ROW, rounded up to whole K tiles."""
        return -(-kh * self.k_row // block_k) * block_k

    def row_align(self, stride: tuple[int, int], dilation: tuple[int, int], block_k: int) -> int:
        """The power of two (elements) that divides the first element of every contiguous run the
        conv reads from x_pad (what tl.multiple_of may state), at most 16 bytes: a run starts at a
        window row (n, oh*STRIDE_H + kh*DIL_H, ow*STRIDE_W) plus a K chunk's offset in the row (a
        multiple of min(BLOCK_K, K_ROW)), and with dilation along W at each tap (kw*DIL_W*C_PAD)."""
        sxn, _, sxh, sxw = self.strides
        g = 0
        for v in (sxn, sxh * stride[0], sxh * dilation[0], sxw * stride[1], min(block_k, self.k_row)):
            g = math.gcd(g, v)
        if dilation[1] > 1:
            g = math.gcd(g, sxw * dilation[1])
        return min(_pow2_dividing(g), max(1, VECTOR_BYTES // self.itemsize))


def geometry(x_shape: tuple[int, int, int, int], kw: int, padding: tuple[int, int], itemsize: int) -> PaddedGeometry:
    """x_pad's layout for an input of NCHW-logical `x_shape` and a filter KW wide."""
    n, c, h, w = x_shape
    c_pad = _pow2_at_least(c)
    return _laid_out(n, c_pad, h + 2 * padding[0], w + 2 * padding[1], _pow2_at_least(kw * c_pad), itemsize)


def _laid_out(n: int, c_pad: int, hp: int, wp: int, k_row: int, itemsize: int, s2d: int = 1,
              c_in_pad: int = 0) -> PaddedGeometry:
    per_vector = max(1, VECTOR_BYTES // itemsize)          # elements per 16 bytes
    step = max(1, per_vector // c_pad)                     # columns that make the row pitch 16-byte aligned
    wa = -(-wp // step) * step
    return PaddedGeometry(c_pad, k_row, hp, wa, (n, c_pad, hp, wa), (hp * wa * c_pad, 1, wa * c_pad, c_pad),
                          itemsize, s2d, c_in_pad)


def s2d_geometry(x_shape: tuple[int, int, int, int], w_shape: tuple[int, int, int, int], stride: int,
                 out_hw: tuple[int, int], itemsize: int) -> PaddedGeometry:
    """The s2d variant's buffer: the zero-padded input regrouped into stride x stride blocks, so the
    convolution becomes a stride-1 one with a ceil(K/stride)-sized filter over C_PAD = stride^2 *
    C_in_pad channels, its output rows OH + KHs - 1 and columns OW + KWs - 1 (past the padded image:
    zeros, read only by zero taps)."""
    n, c, _, _ = x_shape
    kh_s, kw_s = -(-w_shape[2] // stride), -(-w_shape[3] // stride)
    c_in_pad = _pow2_at_least(c)
    c_pad = stride * stride * c_in_pad
    return _laid_out(n, c_pad, out_hw[0] + kh_s - 1, out_hw[1] + kw_s - 1, kw_s * c_pad, itemsize, stride, c_in_pad)


def load_pad_kernel() -> Any:
    from ..codegen.compile import load_triton_function
    return load_triton_function(PAD_SOURCE, PAD_KERNEL_NAME)


class OperandPadder:
    """(x, w[, scale]) in any strides -> (x_pad, w_pad), fresh scratch buffers in the padded (or
    space-to-depth) layouts, one launch. With `fold_scale` w_pad is w times a per-output-channel fp32
    scale (a batchnorm's, so the conv's epilogue keeps only the shift: on the H200 ResNet-50's stem
    with scale, shift and relu in its store took 0.355 ms against 0.304 with shift and relu)."""

    def __init__(self, geom: PaddedGeometry, w_shape: tuple[int, int, int, int], padding: tuple[int, int],
                 block_k: int, fold_scale: bool = False) -> None:
        co, c_in, kh, kw = w_shape
        self.geom, self.fn = geom, load_pad_kernel()
        # the s2d variant's conv reads w_pad through strides (its K = KHs * K_ROW exactly), the padded
        # one in whole K tiles
        self.k_pad = -(-kh // geom.s2d) * geom.k_row if geom.s2d > 1 else geom.k_pad(kh, block_k)
        self.w_shape = (co, self.k_pad)
        self.x_programs = -(-geom.numel // PAD_BLOCK)
        self.grid = (self.x_programs + -(-co * self.k_pad // PAD_BLOCK),)
        self.fold_scale = fold_scale
        self.constexprs = {"C_IN": c_in, "C_PAD": geom.c_pad, "KH": kh, "KW": kw, "K_ROW": geom.k_row,
                           "KP": self.k_pad, "PAD_H": padding[0], "PAD_W": padding[1], "S2D": geom.s2d,
                           "C_IN_PAD": geom.c_group, "HAS_SCALE": fold_scale,
                           "INDEX_64": geom.numel + PAD_BLOCK >= 2**31, "BLOCK": PAD_BLOCK}

    def empty(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xp = torch.empty_strided(self.geom.shape, self.geom.strides, dtype=x.dtype, device=x.device)
        return xp, torch.empty(self.w_shape, dtype=w.dtype, device=w.device)

    def _args(self, x: torch.Tensor, w: torch.Tensor, xp: torch.Tensor, wp: torch.Tensor,
              scale: torch.Tensor | None) -> list[Any]:
        g = self.geom
        if self.fold_scale and scale is None:
            raise ValueError(f"{PAD_KERNEL_NAME}: built to fold a scale into the weight, called without one")
        return [x, xp, w, wp, scale if scale is not None else w, g.numel, self.x_programs, wp.numel(),
                x.shape[2], x.shape[3], g.hp, g.wa, *x.stride(), *w.stride()]

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        xp, wp = self.empty(x, w)
        self.fn[self.grid](*self._args(x, w, xp, wp, scale), **self.constexprs, num_warps=PAD_WARPS)
        return xp, wp

    def warmup(self, x: torch.Tensor, w: torch.Tensor) -> Any:
        """Compile without launching (tune/precompile.py)."""
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device) if self.fold_scale else None
        return self.fn.warmup(*self._args(x, w, *self.empty(x, w), scale), grid=self.grid, **self.constexprs,
                              num_warps=PAD_WARPS)
