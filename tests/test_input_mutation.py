"""Inputs mutated by an inference graph (frontends/input_mutation.py): a static KV cache written by
index_copy_ / index_put_ / slice assignment is written in place inside the fusegraph Plan (only the new
rows; no clone of the cache, no copy_ back); other mutations are computed and copied back in torch.
Every case: outputs and buffers match eager after every step."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import rel_err
from fusegraph.frontends.input_mutation import INPLACE_IR_OPS, reinplace_input_mutations
from fusegraph.frontends.torch_partition import partition_graph

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_dynamo():  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


class Decode(nn.Module):
    """A decode step with a static [B, H, S, D] KV cache; `write` says how the new k/v go in."""

    def __init__(self, write: str, b: int = 1, h: int = 2, s: int = 8, d: int = 4) -> None:
        super().__init__()
        self.write = write
        self.proj = nn.Linear(d, 2 * d)
        self.register_buffer("k_cache", torch.zeros(b, h, s, d))
        self.register_buffer("v_cache", torch.zeros(b, h, s, d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k, v = self.proj(x).chunk(2, dim=-1)                 # [B, H, 1, D] each
        if self.write == "index_copy_":
            k_all = self.k_cache.index_copy_(2, pos, k)
            v_all = self.v_cache.index_copy_(2, pos, v)
        else:                                                 # slice assignment at a tensor position
            self.k_cache[:, :, pos] = k
            self.v_cache[:, :, pos] = v
            k_all, v_all = self.k_cache, self.v_cache
        mask = (torch.arange(k_all.shape[2]) <= pos)[None]      # [1, S]: the positions written so far
        return F.scaled_dot_product_attention(x, k_all, v_all, attn_mask=mask)


def _twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    eager = make()
    mine = make()
    mine.load_state_dict(eager.state_dict())
    return eager, mine


def _steps(eager: nn.Module, compiled: Any, mine: nn.Module, inputs: list[tuple[Any, ...]]) -> None:
    """Each step's output and every buffer match eager after every step."""
    with torch.no_grad():
        for step, args in enumerate(inputs):
            want, got = eager(*args), compiled(*args)
            assert rel_err(got, want) < 1e-5, f"step {step}: output"
            for (name, ref), (_, buf) in zip(eager.named_buffers(), mine.named_buffers(), strict=True):
                assert rel_err(buf, ref) < 1e-6, f"step {step}: buffer {name} differs from eager"


def _kernel_ops(report: Any) -> list[str]:
    ops = []
    for graph in report.graphs:
        for part in graph.partitions:
            assert part.status == "fusegraph", part.reason
            ops += [op for k in (part.plan.kernels if part.plan is not None else []) for op in k.ops]
    return ops


@pytest.mark.parametrize("write", ["index_copy_", "slice assignment"])
def test_kv_cache_written_in_place_matches_eager(write: str) -> None:
    eager, mine = _twins(lambda: Decode(write))
    compiled = fg.compile(mine)
    ptrs = [mine.k_cache.data_ptr(), mine.v_cache.data_ptr()]
    _steps(eager, compiled, mine, [(torch.randn(1, 2, 1, 4), torch.tensor([p])) for p in (0, 3, 1, 7, 3)])
    assert [mine.k_cache.data_ptr(), mine.v_cache.data_ptr()] == ptrs   # the same buffers, updated in place
    report = compiled.fusegraph_report
    (graph,) = report.graphs
    assert graph.kind == "inference"
    assert [m.inplace for m in graph.mutations] == [True, True], [str(m) for m in graph.mutations]
    assert report.fallback_ops == {}, report.fallback_ops
    ops = _kernel_ops(report)
    # the scatters write into the caches: no functional (copy + write) scatter, no write-back copy
    assert sum(op in INPLACE_IR_OPS for op in ops) == 2, ops
    assert not {"index_copy", "index_put", "slice_scatter", "copy"} & set(ops), ops
    assert "input mutation: " in str(report) and "written in place" in str(report)
    # the partition's Plan declares the caches static: a captured CUDA graph writes them, not copies
    (part,) = graph.partitions
    assert len(part.plan.static_inputs) >= 2
    # the memory plan counts no cache-sized buffer of its own for the in-place writes
    cache_bytes = mine.k_cache.numel() * mine.k_cache.element_size()
    assert all(b.nbytes < cache_bytes for b in part.plan.memory.buffers), part.plan.memory.buffers


def test_fx_graph_given_to_partitioning_has_no_write_back() -> None:
    """The ATen graph AOTAutograd hands over ends with copy_(cache, index_copy(cache, ...)); after the
    rewrite there is no copy_ and no functional scatter left: one index_copy_ on the placeholder."""
    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        from fusegraph.frontends.input_mutation import aot_autograd_options

        def inference(fx: torch.fx.GraphModule, args: Any) -> Any:
            before = [n.target for n in fx.graph.nodes if n.op == "call_function"]
            assert aten.copy_.default in before and aten.index_copy.default in before
            mutations = reinplace_input_mutations(fx)
            assert [m.inplace for m in mutations] == [True, True]
            targets = [n.target for n in fx.graph.nodes if n.op == "call_function"]
            assert aten.copy_.default not in targets and aten.index_copy.default not in targets
            writes = [n for n in fx.graph.nodes if n.target is aten.index_copy_.default]
            assert len(writes) == 2 and all(n.args[0].op == "placeholder" for n in writes)
            seen.append(fx)
            split, _ = partition_graph(fx, "inference", {}, lambda message: None, [0, 1])
            return make_boxed_func(split)

        return aot_autograd(fw_compiler=inference, inference_compiler=inference, **aot_autograd_options())(
            gm, example_inputs)

    eager, mine = _twins(lambda: Decode("index_copy_"))
    compiled = torch.compile(mine, backend=backend)
    _steps(eager, compiled, mine, [(torch.randn(1, 2, 1, 4), torch.tensor([p])) for p in (2, 5)])
    assert len(seen) == 1


def test_torch_compile_backend_name_decode_steps() -> None:
    eager, mine = _twins(lambda: Decode("index_copy_", b=2, h=2, s=6, d=8))
    compiled = torch.compile(mine, backend="fusegraph", dynamic=False)
    _steps(eager, compiled, mine, [(torch.randn(2, 2, 1, 8), torch.tensor([p])) for p in range(6)])


class SliceWrite(nn.Module):
    """Slice assignment at fixed positions: one slice (a slice_scatter into the buffer: in place), or
    a slice and then a select (nested into one new value, which the core ATen table turns into a
    `where`: computed and copied back)."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.nested = nested
        self.register_buffer("cache", torch.zeros(2, 6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[:, 2:4] = x
        if self.nested:
            self.cache[:, 5] = x[:, 0] * 2
        return self.cache.sum(1) + 1


@pytest.mark.parametrize("nested", [False, True])
def test_slice_assignment_matches_eager(nested: bool) -> None:
    eager, mine = _twins(lambda: SliceWrite(nested))
    compiled = fg.compile(mine)
    _steps(eager, compiled, mine, [(torch.randn(2, 2, 4),) for _ in range(3)])
    (graph,) = compiled.fusegraph_report.graphs
    (mutation,) = graph.mutations   # one new value per mutated buffer
    assert mutation.inplace is not nested, str(mutation)
    ops = _kernel_ops(compiled.fusegraph_report)
    assert ("index_put_inplace" in ops) is not nested and ("slice_scatter" in ops) is nested, ops


class OldValueRead(nn.Module):
    """The cache's old value is read after the update (a snapshot taken before it): the scatter
    cannot write into the cache, the safe path computes the new value and copies it back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.randn(1, 2, 6, 4))

    def forward(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        before = self.cache * 1.0
        new = self.cache.index_copy_(2, pos, k)
        return new.sum(2) - before.sum(2) + before.amax(2)


def test_old_value_read_after_update_falls_back_and_matches() -> None:
    eager, mine = _twins(OldValueRead)
    compiled = fg.compile(mine)
    _steps(eager, compiled, mine, [(torch.randn(1, 2, 1, 4), torch.tensor([p])) for p in (1, 4, 1)])
    (graph,) = compiled.fusegraph_report.graphs
    (mutation,) = graph.mutations
    assert not mutation.inplace and "also read by" in mutation.reason, str(mutation)
    ops = _kernel_ops(compiled.fusegraph_report)
    assert "index_copy" in ops and not set(ops) & INPLACE_IR_OPS


class Counter(nn.Module):
    """Buffer mutations that are not scatters: add_, mul_ of a user's input, an accumulating index_put_."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(3))
        self.register_buffer("hist", torch.zeros(5))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.hist.index_put_((ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        return x * self.steps.sum() + self.hist[:3]


def test_non_scatter_mutations_stay_correct() -> None:
    eager, mine = _twins(Counter)
    compiled = fg.compile(mine)
    _steps(eager, compiled, mine, [(torch.randn(3), torch.tensor([1, 1, 4])) for _ in range(3)])
    (graph,) = compiled.fusegraph_report.graphs
    assert len(graph.mutations) == 2 and not any(m.inplace for m in graph.mutations)
    assert compiled.fusegraph_report.fallback_ops == {}   # a write-back is not an op of the model


class WriteOnly(nn.Module):
    """The cache is written and nothing in the graph reads the new value; the output is the
    updated cache itself (it aliases the buffer, as in eager) in the second variant."""

    def __init__(self, return_cache: bool) -> None:
        super().__init__()
        self.return_cache = return_cache
        self.register_buffer("cache", torch.zeros(6, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.cache.index_copy_(0, pos, torch.tanh(x))
        return out if self.return_cache else x * 2


# returning the mutated buffer: torch's AOTAutograd cannot keep that mutation in the graph; the backend
# retries with AOTAutograd applying it (torch_backend.Session._compile_static), not eager torch
@pytest.mark.filterwarnings("error::fusegraph.frontends.torch_partition.FallbackWarning")
@pytest.mark.parametrize("return_cache", [False, True])
def test_write_without_readers(return_cache: bool) -> None:
    eager, mine = _twins(lambda: WriteOnly(return_cache))
    compiled = fg.compile(mine)
    inputs = [(torch.randn(2, 4), torch.tensor([p, p + 1])) for p in (0, 3, 2)]
    _steps(eager, compiled, mine, inputs)
    if return_cache:
        with torch.no_grad():
            x, pos = torch.randn(2, 4), torch.tensor([4, 1])
            out = compiled(x, pos)
            eager(x, pos)
        assert torch.equal(out, mine.cache)
        assert compiled.fusegraph_report.graphs, "the graph ran in torch, not through fusegraph"
    else:
        (graph,) = compiled.fusegraph_report.graphs
        assert [m.inplace for m in graph.mutations] == [True]


def test_user_input_mutated_in_place() -> None:
    """A mutated graph input that is not a buffer: the caller's tensor is updated (in place)."""

    def step(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, x)
        return cache.mean(1)

    compiled = fg.compile(step)
    mine, ref = torch.zeros(2, 5, 3), torch.zeros(2, 5, 3)
    with torch.no_grad():
        for p in (0, 2, 4):
            x, pos = torch.randn(2, 1, 3), torch.tensor([p])
            assert rel_err(compiled(mine, x, pos), step(ref, x, pos)) < 1e-6
            assert torch.equal(mine, ref)
    (graph,) = compiled.fusegraph_report.graphs
    assert [m.inplace for m in graph.mutations] == [True]
    (part,) = graph.partitions
    # not a parameter or buffer, but written in place: static, so a captured CUDA graph would write
    # the caller's tensor (and a call with another tensor runs kernel by kernel), never a copy of it
    assert len(part.plan.static_inputs) == 1


def test_llama_decode_block_cache_in_place() -> None:
    """bench/llama_blocks.py's decode block (the GPU target): one partition, both caches written in
    place by the Plan, outputs and caches equal to eager over several steps."""
    sys.path.insert(0, BENCH)
    from llama_blocks import LlamaDecodeBlock, LlamaSize

    size = LlamaSize(batch=1, seq=6, dim=32, heads=4, kv_heads=2, ffn=48)
    eager, mine = _twins(lambda: LlamaDecodeBlock(size))
    compiled = fg.compile(mine, mode="reduce-overhead")
    x = torch.randn(1, size.seq, size.dim)
    _steps(eager, compiled, mine, [(x[:, p:p + 1], torch.tensor([p])) for p in range(4)])
    (graph,) = compiled.fusegraph_report.graphs
    assert [m.inplace for m in graph.mutations] == [True, True]
    ops = _kernel_ops(compiled.fusegraph_report)
    assert ops.count("index_copy_inplace") == 2 and "index_copy" not in ops
