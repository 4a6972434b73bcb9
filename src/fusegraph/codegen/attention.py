"""Flash-style attention in Triton: forward (online softmax over key blocks, never an Sq x Sk
matrix in memory, returns the log-sum-exp) and backward (dk/dv per key block looping over query
blocks and the heads of its GQA group; dq per query block looping over key blocks).

Semantics follow ops/attention.py: scale * q @ k^T, an additive float or a boolean mask
broadcast to [B, H, Sq, Sk] by strides, causal = top-left triangle (key j visible to query i when
j <= i), GQA (query head h reads kv head h // (H / Hk)); a query row with every key masked gives
out = 0 and lse = -inf. Scores are kept in the log2 domain (exp2) inside the kernels.

The kernels are fixed templates (options are constexprs), loaded through codegen.compile so the
same source runs on the GPU and under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .compile import load_triton_function

LOG2E = 1.4426950408889634
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)

_COMMON = '''
import triton
import triton.language as tl


@triton.jit
def _scores(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, EDGE: tl.constexpr):
    # EDGE: the block may cross the causal diagonal or the end of the keys (masks needed)
    if EDGE:
        k = tl.load(K + kb + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=offs_n[None, :] < SK, other=0.0)
    else:
        k = tl.load(K + kb + offs_n[None, :] * skn + offs_d[:, None] * skd)
    s = tl.dot(q, k) * scale_log2
    if EDGE:
        valid = (offs_n[None, :] < SK) & (offs_m[:, None] < SQ)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
    else:
        valid = (offs_m[:, None] < SQ) & (offs_n[None, :] >= 0)
    if MASK_KIND == 1:
        add = tl.load(Mask + mb + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=valid, other=0.0)
        s = s + add.to(tl.float32) * 1.4426950408889634
    if MASK_KIND == 2:
        keep = tl.load(Mask + mb + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=valid, other=0)
        valid = valid & (keep != 0)
    if EDGE or MASK_KIND != 0:
        s = tl.where(valid, s, float("-inf"))
    return s, k


@triton.jit
def _forward_block(acc, m_i, l_i, q, K, V, kb, vb, start_n, offs_d, offs_dv, offs_m, skn, skd, svn, svd, SQ, SK,
                   Mask, mb, smm, smn, scale_log2, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, EDGE: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s, k = _scores(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2,
                   CAUSAL, MASK_KIND, EDGE)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if EDGE:
        v = tl.load(V + vb + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=offs_n[:, None] < SK, other=0.0)
    else:
        v = tl.load(V + vb + offs_n[:, None] * svn + offs_dv[None, :] * svd)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i
'''

FORWARD_SOURCE = _COMMON + '''

@triton.jit
def attention_fwd(Q, K, V, Mask, Out, Lse,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                  smb, smh, smm, smn, sob, soh, som, sod,
                  H, SQ, SK, GROUP, scale_log2,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                  CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    row_ok = offs_m < SQ
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None],
                other=0.0)
    kb = b * skb + hk * skh
    vb = b * svb + hk * svh
    mb = b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], tl.float32)
    # keys every query of the block sees (no masks), then the blocks on the diagonal / the tail
    full = (SK // BLOCK_N) * BLOCK_N
    hi = SK
    if CAUSAL:
        full = tl.minimum(full, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _forward_block(acc, m_i, l_i, q, K, V, kb, vb, start_n, offs_d, offs_dv, offs_m, skn, skd,
                                       svn, svd, SQ, SK, Mask, mb, smm, smn, scale_log2, BLOCK_N, CAUSAL,
                                       MASK_KIND, False)
    for start_n in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _forward_block(acc, m_i, l_i, q, K, V, kb, vb, start_n, offs_d, offs_dv, offs_m, skn, skd,
                                       svn, svd, SQ, SK, Mask, mb, smm, smn, scale_log2, BLOCK_N, CAUSAL,
                                       MASK_KIND, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    tl.store(Lse + bh.to(tl.int64) * SQ + offs_m, lse, mask=row_ok)
'''

BACKWARD_SOURCE = _COMMON + '''

@triton.jit
def _probs(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2, lse2,
           CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    s, k = _scores(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2,
                   CAUSAL, MASK_KIND, True)
    return tl.math.exp2(s - lse2[:, None]), k


@triton.jit
def attention_bwd_dkdv(Q, K, V, Mask, DO, Lse, Delta, DK, DV,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                       smb, smh, smm, smn, sob, soh, som, sod,
                       H, HK, SQ, SK, GROUP, scale_log2, scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                       HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    col_ok = offs_n < SK
    kb = b * skb + hk * skh
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=col_ok[:, None],
                other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DV], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        mb = b * smb + h * smh
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < SQ
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                        mask=row_ok[:, None], other=0.0)
            row = (b * H + h) * SQ + offs_m
            lse = tl.load(Lse + row, mask=row_ok, other=float("inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            p, k = _probs(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2, lse2,
                          CAUSAL, MASK_KIND)
            do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                         mask=row_ok[:, None], other=0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            delta = tl.load(Delta + row, mask=row_ok, other=0.0)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    # dk/dv are contiguous [B, HK, SK, D]
    base = bhk.to(tl.int64) * SK
    tl.store(DK + (base + offs_n[:, None]) * HEAD_D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None])
    tl.store(DV + (base + offs_n[:, None]) * HEAD_DV + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None])


@triton.jit
def attention_bwd_dq(Q, K, V, Mask, DO, Lse, Delta, DQ,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     smb, smh, smm, smn, sob, soh, som, sod,
                     H, SQ, SK, GROUP, scale_log2, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                     HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    row_ok = offs_m < SQ
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None],
                other=0.0)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod, mask=row_ok[:, None],
                 other=0.0)
    row = bh.to(tl.int64) * SQ + offs_m
    lse = tl.load(Lse + row, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row, mask=row_ok, other=0.0)
    kb = b * skb + hk * skh
    vb = b * svb + hk * svh
    mb = b * smb + h * smh
    dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p, k = _probs(q, K, kb, offs_n, offs_d, offs_m, skn, skd, SQ, SK, Mask, mb, smm, smn, scale_log2, lse2,
                      CAUSAL, MASK_KIND)
        v = tl.load(V + vb + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=offs_n[:, None] < SK, other=0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    tl.store(DQ + (bh.to(tl.int64) * SQ + offs_m[:, None]) * HEAD_D + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
'''


# Split-KV ("flash-decoding") forward for few query rows: a decode step's one query per head reads the
# whole KV cache, and the forward kernel above gives it one program per (batch, head), too few to stream
# the cache at full bandwidth. Here a program takes one kv head, all the query rows of its GQA group
# (GROUP heads x SQ queries: ROWS rows, each KV tile loaded once for all of them) and one chunk of the
# keys; partial outputs (unnormalized, fp32) with their row max and sum go to a workspace, and a second
# kernel merges the chunks of each row in chunk order (the same result every run).
DECODE_SOURCE = """
import triton
import triton.language as tl


@triton.jit
def attention_decode_partial(Q, K, V, Mask, Pacc, Pml,
                             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                             smb, smh, smm, smn, HK, SQ, SK, GROUP, ROWS, CHUNK, SPLITS, scale_log2,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                             HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    split = tl.program_id(0)
    bk = tl.program_id(1)
    b = (bk // HK).to(tl.int64)
    hk = (bk % HK).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    h = hk * GROUP + rows // SQ            # the query head and query index of each row
    m = rows % SQ
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None],
                other=0.0)
    kb = b * skb + hk * skh
    vb = b * svb + hk * svh
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, SK)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        # both tiles requested before any math: their loads are in flight together
        k = tl.load(K + kb + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=key_ok[None, :], other=0.0)
        v = tl.load(V + vb + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, k) * scale_log2
        valid = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= m[:, None])
        if MASK_KIND == 1:
            add = tl.load(Mask + b * smb + h[:, None] * smh + m[:, None] * smm + offs_n[None, :] * smn, mask=valid,
                          other=0.0)
            s = s + add.to(tl.float32) * 1.4426950408889634
        if MASK_KIND == 2:
            keep = tl.load(Mask + b * smb + h[:, None] * smh + m[:, None] * smm + offs_n[None, :] * smn, mask=valid,
                           other=0)
            valid = valid & (keep != 0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # only the group's rows (ROWS of the BLOCK_M) reach the workspace
    at = (bk.to(tl.int64) * ROWS + rows) * SPLITS + split
    tl.store(Pacc + at[:, None] * HEAD_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
    tl.store(Pml + at * 2, m_i, mask=row_ok)
    tl.store(Pml + at * 2 + 1, l_i, mask=row_ok)


@triton.jit
def attention_decode_merge(Pacc, Pml, Out, Lse, sob, soh, som, sod, HK, SQ, GROUP, ROWS, SPLITS,
                           HEAD_DV: tl.constexpr, SPLITS_P2: tl.constexpr):
    # one program per query row: its SPLITS partials loaded at once ([SPLITS, HEAD_DV] fp32)
    bk = tl.program_id(0)
    row = tl.program_id(1)
    b = (bk // HK).to(tl.int64)
    hk = (bk % HK).to(tl.int64)
    offs_dv = tl.arange(0, HEAD_DV)
    splits = tl.arange(0, SPLITS_P2)
    ok = splits < SPLITS
    at = (bk.to(tl.int64) * ROWS + row) * SPLITS + splits
    m_s = tl.load(Pml + at * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(Pml + at * 2 + 1, mask=ok, other=0.0)
    acc_s = tl.load(Pacc + at[:, None] * HEAD_DV + offs_dv[None, :], mask=ok[:, None], other=0.0)
    m_max = tl.max(m_s, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m_s - m_safe)
    l_tot = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc_s, 0) / tl.where(l_tot > 0, l_tot, 1.0)
    h = hk * GROUP + row // SQ
    m = row % SQ
    tl.store(Out + b * sob + h * soh + m * som + offs_dv * sod, out.to(Out.dtype.element_ty))
    tl.store(Lse + (b * HK * GROUP + h) * SQ + m, (m_max + tl.math.log2(l_tot)) * 0.6931471805599453)
"""
DECODE_MAX_ROWS = 64        # GQA group x query rows one split-KV program takes (its BLOCK_M)
# split the keys until (batch x kv heads x splits) is about one per SM: in the H200 sweep
# (bench/results/decode_attention_20261201_1803.txt), with 64-key tiles and 3 stages, 14.8, 23.1, 69.0
# and 67.5 us at (batch, keys) = (1, 8k), (8, 2k), (8, 8k), (32, 2k), against 16.8, 24.6, 78.6 and 75.9
# with two programs per SM and 2 stages (the first default)
DECODE_TARGET_PROGRAMS = 132

@dataclass(frozen=True)
class AttentionProblem:
    batch: int
    heads: int
    kv_heads: int
    sq: int
    sk: int
    head_dim: int
    head_dim_v: int
    causal: bool
    mask_kind: int          # 0 none, 1 additive float, 2 boolean
    scale: float
    dtype: torch.dtype


@functools.cache
def _kernel(source_name: str) -> Any:
    """The jitted kernel named `source_name`, loaded once per process."""
    if source_name == "attention_fwd":
        return load_triton_function(FORWARD_SOURCE, source_name)
    if source_name.startswith("attention_decode"):
        return load_triton_function(DECODE_SOURCE, source_name)
    return load_triton_function(BACKWARD_SOURCE, source_name)


def attention_supported(problem: AttentionProblem) -> str | None:
    """None when the Triton kernels cover the problem, else why not (it then goes to torch SDPA)."""
    if problem.dtype not in ATTENTION_DTYPES:
        return f"dtype {problem.dtype} (the Triton attention kernels take float16/bfloat16)"
    if problem.head_dim not in HEAD_DIMS or problem.head_dim_v not in HEAD_DIMS:
        return f"head dims {problem.head_dim}/{problem.head_dim_v} (Triton kernels take {HEAD_DIMS})"
    if min(problem.sq, problem.sk, problem.batch, problem.heads) == 0:
        return "empty attention"
    return None


def attention_configs(problem: AttentionProblem) -> list[dict[str, Any]]:
    """Forward tile candidates, best guess first (Hopper: 128x128 tiles, 8 warps for D=128)."""
    cap_m = max(16, 1 << (problem.sq - 1).bit_length())
    cap_n = max(16, 1 << (problem.sk - 1).bit_length())
    big = problem.head_dim >= 128
    tiles = [(128, 64 if big else 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2)]
    out: list[dict[str, Any]] = []
    for bm, bn, warps, stages in tiles:
        cfg = {"BLOCK_M": min(bm, cap_m), "BLOCK_N": min(bn, cap_n), "num_warps": warps, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out


def decode_config(problem: AttentionProblem, sms: int = 132) -> dict[str, Any] | None:
    """The split-KV kernels' config (VARIANT "decode") for a problem with few query rows per kv head
    (GQA group x Sq <= DECODE_MAX_ROWS), else None: BLOCK_M the rows padded to >= 16 (tl.dot),
    64-key tiles, 3 stages, keys split into SPLITS chunks (whole tiles) so that batch x kv heads x
    SPLITS is about DECODE_TARGET_PROGRAMS (scaled to `sms`)."""
    rows = problem.sq * (problem.heads // problem.kv_heads)
    if rows > DECODE_MAX_ROWS:
        return None
    bn = 64 if problem.head_dim <= 128 else 32
    tiles = -(-problem.sk // bn)
    target = DECODE_TARGET_PROGRAMS * sms // 132
    splits = max(1, min(tiles, -(-target // (problem.batch * problem.kv_heads))))
    chunk = -(-tiles // splits) * bn
    return {"VARIANT": "decode", "BLOCK_M": max(16, 1 << (rows - 1).bit_length()), "BLOCK_N": bn,
            "SPLITS": -(-problem.sk // chunk), "CHUNK": chunk, "num_warps": 4, "num_stages": 3}


def decode_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 p: AttentionProblem, config: dict[str, Any], out_strides: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[Call]]:
    """(out, lse, the two launches that fill them) of the split-KV kernels: partials per (batch, kv
    head, chunk of keys) into an fp32 workspace, then the merge per (batch, kv head)."""
    shape = (p.batch, p.heads, p.sq, p.head_dim_v)
    out = torch.empty(shape, dtype=q.dtype, device=q.device) if out_strides is None else \
        torch.empty_strided(shape, out_strides, dtype=q.dtype, device=q.device)
    lse = torch.empty((p.batch, p.heads, p.sq), dtype=torch.float32, device=q.device)
    mask_t, ms = _mask_view(mask, p)
    bm, bn, splits, chunk = (int(config[key]) for key in ("BLOCK_M", "BLOCK_N", "SPLITS", "CHUNK"))
    group = p.heads // p.kv_heads
    programs = p.batch * p.kv_heads
    rows = group * p.sq
    pacc = torch.empty((programs * rows * splits * p.head_dim_v,), dtype=torch.float32, device=q.device)
    pml = torch.empty((programs * rows * splits * 2,), dtype=torch.float32, device=q.device)
    common = (p.kv_heads, p.sq)
    partial = (_kernel("attention_decode_partial"), (splits, programs),
               (q, k, v, q if mask_t is None else mask_t, pacc, pml, *_strides4(q), *_strides4(k), *_strides4(v),
                *ms, *common, p.sk, group, group * p.sq, chunk, splits, p.scale * LOG2E),
               {"BLOCK_M": bm, "BLOCK_N": bn, "HEAD_D": p.head_dim, "HEAD_DV": p.head_dim_v, "CAUSAL": p.causal,
                "MASK_KIND": p.mask_kind, "num_warps": int(config.get("num_warps", 4)),
                "num_stages": int(config.get("num_stages", 2))})
    merge = (_kernel("attention_decode_merge"), (programs, group * p.sq),
             (pacc, pml, out, lse, *_strides4(out), *common, group, group * p.sq, splits),
             {"HEAD_DV": p.head_dim_v, "SPLITS_P2": max(2, 1 << (splits - 1).bit_length()), "num_warps": 4})
    return out, lse, [partial, merge]


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    if t is None:
        return (0, 0, 0, 0)
    s = t.stride()
    return (s[0], s[1], s[2], s[3])


def _mask_view(mask: torch.Tensor | None, p: AttentionProblem) -> tuple[torch.Tensor | None, tuple[int, int, int, int]]:
    if mask is None:
        return None, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes; Triton loads it as integers
    full = mask.expand(p.batch, p.heads, p.sq, p.sk)  # broadcast dims get stride 0: nothing copied
    return full, _strides4(full)


Call = tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]   # (kernel, grid, args, constexprs)


def forward_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  p: AttentionProblem, config: dict[str, Any], out_strides: tuple[int, ...] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[Call]]:
    """(out, lse, the launch that fills them): what attention_forward runs, and what a compile-ahead
    job (backends/attention_kernel.attention_warmup_jobs) hands to Triton's warmup."""
    fn = _kernel("attention_fwd")
    shape = (p.batch, p.heads, p.sq, p.head_dim_v)
    out = torch.empty(shape, dtype=q.dtype, device=q.device) if out_strides is None else \
        torch.empty_strided(shape, out_strides, dtype=q.dtype, device=q.device)
    lse = torch.empty((p.batch, p.heads, p.sq), dtype=torch.float32, device=q.device)
    mask_t, ms = _mask_view(mask, p)
    bm, bn = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    grid = (-(-p.sq // bm), p.batch * p.heads)
    args = (q, k, v, q if mask_t is None else mask_t, out, lse, *_strides4(q), *_strides4(k), *_strides4(v), *ms,
            *_strides4(out), p.heads, p.sq, p.sk, p.heads // p.kv_heads, p.scale * LOG2E)
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "HEAD_D": p.head_dim, "HEAD_DV": p.head_dim_v, "CAUSAL": p.causal,
              "MASK_KIND": p.mask_kind, "num_warps": int(config.get("num_warps", 4)),
              "num_stages": int(config.get("num_stages", 2))}
    return out, lse, [(fn, grid, args, consts)]


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      p: AttentionProblem, config: dict[str, Any],
                      out_strides: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, Dv] in q's dtype, contiguous or in `out_strides`; lse [B, H, Sq] fp32) with
    the Triton forward kernel."""
    make = decode_calls if config.get("VARIANT") == "decode" else forward_calls
    out, lse, calls = make(q, k, v, mask, p, config, out_strides)
    for fn, grid, args, consts in calls:
        fn[grid](*args, **consts)
    return out, lse


def backward_calls(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, mask: torch.Tensor | None, p: AttentionProblem, config: dict[str, Any]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Call]]:
    """(dq, dk, dv, the two launches that fill them) from the fp32 lse and delta = rowsum(dO * O)."""
    mask_t, ms = _mask_view(mask, p)
    dq = torch.empty((p.batch, p.heads, p.sq, p.head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty((p.batch, p.kv_heads, p.sk, p.head_dim), dtype=q.dtype, device=q.device)
    dv = torch.empty((p.batch, p.kv_heads, p.sk, p.head_dim_v), dtype=q.dtype, device=q.device)
    bm, bn = int(config.get("BWD_BLOCK_M", 64)), int(config.get("BWD_BLOCK_N", 64))
    bm = min(bm, max(16, 1 << (p.sq - 1).bit_length()))
    bn = min(bn, max(16, 1 << (p.sk - 1).bit_length()))
    if p.causal:
        bm = bn = min(bm, bn)  # the causal start of the dk/dv loop assumes aligned blocks
    common = (*_strides4(q), *_strides4(k), *_strides4(v), *ms, *_strides4(grad_out))
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "HEAD_D": p.head_dim, "HEAD_DV": p.head_dim_v, "CAUSAL": p.causal,
              "MASK_KIND": p.mask_kind, "num_warps": int(config.get("bwd_warps", 4))}
    mask_arg = q if mask_t is None else mask_t
    group = p.heads // p.kv_heads
    dkdv = (_kernel("attention_bwd_dkdv"), (-(-p.sk // bn), p.batch * p.kv_heads),
            (q, k, v, mask_arg, grad_out, lse, delta, dk, dv, *common, p.heads, p.kv_heads, p.sq, p.sk, group,
             p.scale * LOG2E, p.scale), consts)
    dq_call = (_kernel("attention_bwd_dq"), (-(-p.sq // bm), p.batch * p.heads),
               (q, k, v, mask_arg, grad_out, lse, delta, dq, *common, p.heads, p.sq, p.sk, group, p.scale * LOG2E,
                p.scale), consts)
    return dq, dk, dv, [dkdv, dq_call]


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, p: AttentionProblem,
                       config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in q's dtype."""
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    dq, dk, dv, calls = backward_calls(grad_out, q, k, v, lse.float().contiguous(), delta, mask, p, config)
    for fn, grid, args, consts in calls:
        fn[grid](*args, **consts)
    return dq, dk, dv


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
