"""Decode-step attention (one query per head, GQA) on the H200: our split-KV kernels
(codegen/attention.py decode_calls) against torch SDPA's backends, over KV lengths and batches.

Each call is timed inside one CUDA graph, rotating over enough KV caches that every call reads its
cache from HBM (as a decode step does after streaming the weights); floor = KV bytes / 4.2 TB/s.

    PYTHONPATH=src python bench/decode_attention_gpu.py

Output to stdout and $OUT/decode_attention.txt.
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusegraph.codegen.attention import AttentionProblem, attention_forward, decode_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_gpu import graph_time
from host_syncs_gpu import emit

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main() -> None:
    def say(line: str) -> None:
        emit(line, "decode_attention.txt")

    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; heads 32 / kv 8, head dim 128, bf16, "
        "additive mask [B, 1, 1, S]")
    dt = torch.bfloat16
    for batch, seq in ((1, 2048), (1, 8192), (1, 32768), (8, 2048), (8, 8192), (32, 2048)):
        h, hk, d = 32, 8, 128
        kv_bytes = 2 * batch * hk * seq * d * 2
        copies = max(2, int(300e6 // kv_bytes) + 1)
        q = torch.randn(batch, h, 1, d, device="cuda", dtype=dt)
        ks = [torch.randn(batch, hk, seq, d, device="cuda", dtype=dt) for _ in range(copies)]
        vs = [torch.randn(batch, hk, seq, d, device="cuda", dtype=dt) for _ in range(copies)]
        mask = torch.zeros(batch, 1, 1, seq, device="cuda", dtype=dt)
        p = AttentionProblem(batch, h, hk, 1, seq, d, d, False, 1, 1 / math.sqrt(d), dt)
        cfg = decode_config(p, torch.cuda.get_device_properties(0).multi_processor_count)
        assert cfg is not None
        ref = F.scaled_dot_product_attention(q.float(), ks[0].float().repeat_interleave(4, 1),
                                             vs[0].float().repeat_interleave(4, 1), attn_mask=mask.float())
        got, _ = attention_forward(q, ks[0], vs[0], mask, p, cfg)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        state = {"i": 0}

        def ours() -> None:
            state["i"] = (state["i"] + 1) % copies
            attention_forward(q, ks[state["i"]], vs[state["i"]], mask, p, cfg)

        rows = [("split-KV (ours)", graph_time(ours, reps=copies * 2))]
        sweep = []
        for bn, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (2, 3), (1, 2, 4)):
            tiles = -(-seq // bn)
            splits = max(1, min(tiles, -(-per_sm * 132 // (batch * hk))))
            chunk = -(-tiles // splits) * bn
            alt = dict(cfg, BLOCK_N=bn, num_warps=warps, num_stages=stages, CHUNK=chunk, SPLITS=-(-seq // chunk))

            def run_alt(alt: dict = alt) -> None:
                state["i"] = (state["i"] + 1) % copies
                attention_forward(q, ks[state["i"]], vs[state["i"]], mask, p, alt)
            sweep.append((graph_time(run_alt, reps=copies * 2), f"BN {bn} warps {warps} stages {stages} "
                          f"{per_sm}/SM: {alt['SPLITS']} splits of {chunk}"))
        sweep.sort()
        for name, backend in BACKENDS.items():
            def lib(backend: SDPBackend = backend) -> None:
                state["i"] = (state["i"] + 1) % copies
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, ks[state["i"]], vs[state["i"]], attn_mask=mask, enable_gqa=True)
            if name != "cudnn":   # flash and efficient take no GQA with a mask here
                continue
            rows.append((f"torch {name}", graph_time(lib, reps=copies * 2)))
        floor = kv_bytes / 4.2e12 * 1e3
        say(f"B={batch:3d} S={seq:6d} KV {kv_bytes / 1e6:7.1f} MB floor {floor * 1e3:7.1f} us; ours {cfg} "
            f"rel err {err:.2e}")
        for name, ms in rows:
            say(f"   {name:16s} {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e9:5.2f} TB/s")
        for ms, label in sweep[:4]:
            say(f"   sweep {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e9:5.2f} TB/s  {label}")
        ks.clear()
        vs.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
