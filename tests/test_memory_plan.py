"""Memory plan (runtime/memory.py): liveness, arena offsets, in-place elementwise kernels."""

from __future__ import annotations

import itertools

import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.runtime.launch import TritonLaunch
from fusegraph.runtime.memory import (
    ALIGN,
    Buffer,
    Step,
    aligned,
    assign_offsets,
    buffers_of,
    choose_inplace,
    plan_memory,
)
from fusegraph.runtime.plan import Plan


def _check_no_overlap(buffers: list[Buffer], offsets: dict[int, int]) -> None:
    for a, b in itertools.combinations(buffers, 2):
        if a.overlaps(b):
            a_lo, b_lo = offsets[a.slot], offsets[b.slot]
            assert a_lo + a.nbytes <= b_lo or b_lo + b.nbytes <= a_lo, f"{a} and {b} share bytes while both live"


def test_intervals_of_a_chain() -> None:
    # slot 0 input; steps: 0 -> 1 -> 2 -> 3 (output); 2 also read by step 3
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((2, 0), (3,)), Step((3, 2), (4,))]
    nbytes = {k: 1024 for k in range(5)}
    bufs = {b.slot: b for b in buffers_of(steps, nbytes, [4], {}, {0})}
    assert set(bufs) == {1, 2, 3, 4}
    assert (bufs[1].start, bufs[1].end) == (0, 1)
    assert (bufs[2].start, bufs[2].end) == (1, 3)
    assert (bufs[3].start, bufs[3].end) == (2, 3)
    assert (bufs[4].start, bufs[4].end, bufs[4].output) == (3, 4, True)


def test_value_never_read_dies_where_written() -> None:
    steps = [Step((0,), (1, 2)), Step((1,), (3,))]
    bufs = {b.slot: b for b in buffers_of(steps, {k: 10 for k in range(4)}, [3], {}, {0})}
    assert (bufs[2].start, bufs[2].end) == (0, 0)


def test_views_extend_their_base() -> None:
    # 2 is a view of 1, read at step 3: buffer 1 lives to 3; the view has no bytes of its own
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((0,), (3,)), Step((2, 3), (4,))]
    nbytes = {k: 4096 for k in range(5)}
    plan = plan_memory(steps, nbytes, [0], [4], view_of={2: 1})
    bufs = {b.slot: b for b in plan.buffers}
    assert 2 not in bufs and bufs[1].members == (1, 2)
    assert (bufs[1].start, bufs[1].end) == (0, 3)
    assert plan.num_buffers == 2            # 1 (with its view) and 3; 4 is the output
    assert plan.no_reuse_bytes == 2 * 4096
    _check_no_overlap([b for b in plan.buffers if not b.output], plan.offsets)


def test_random_schedules_offsets_never_overlap_while_live() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 12
        steps = []
        for s in range(n):
            reads = tuple(sorted({int(torch.randint(0, s + 1, (1,), generator=gen)) for _ in range(2)}))
            steps.append(Step(reads, (s + 1,)))
        nbytes = {k: int(torch.randint(1, 5000, (1,), generator=gen)) for k in range(n + 1)}
        plan = plan_memory(steps, nbytes, [0], [n])
        arena = [b for b in plan.buffers if not b.output]
        _check_no_overlap(arena, plan.offsets)
        assert all(plan.offsets[b.slot] % ALIGN == 0 for b in arena)
        assert plan.arena_bytes <= sum((b.nbytes + ALIGN - 1) // ALIGN * ALIGN for b in arena), trial
        assert plan.peak_live_bytes <= sum(b.nbytes for b in plan.buffers)


def test_best_fit_reuses_dead_buffers() -> None:
    # a chain: each value read only by the next step; at most two are live at once
    steps = [Step((k,), (k + 1,)) for k in range(6)]
    nbytes = {k: 1 << 20 for k in range(7)}
    plan = plan_memory(steps, nbytes, [0], [6])
    assert plan.num_buffers == 5
    assert plan.arena_bytes == 2 << 20
    assert plan.no_reuse_bytes == 5 << 20
    assert plan.reused == 3
    assert plan.peak_live_bytes == 2 << 20


def test_best_fit_takes_the_smallest_gap() -> None:
    # long-lived 1, 3, 5 leave two holes for 6 (live after 2 and 4 died): 1000 (2's) and 100 (4's)
    sizes = {1: 2000, 2: 1000, 3: 500, 4: 100, 5: 95, 6: 90}
    live = {1: (0, 5), 2: (0, 1), 3: (0, 5), 4: (0, 1), 5: (0, 5), 6: (2, 3)}
    bufs = [Buffer(k, sizes[k] * ALIGN, *live[k], (k,)) for k in sizes]
    offsets, arena = assign_offsets(bufs)
    _check_no_overlap(bufs, offsets)
    assert offsets[6] == offsets[4]                   # the 100-slot hole, not the 1000-slot one
    assert arena == 3695 * ALIGN


def test_inplace_choice_rules() -> None:
    # slot 0: graph input; 1 = f(0); 2 = g(1) elementwise; 3 = h(2, 1)
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((2,), (3,))]
    eligible = {0: [(0, 0)], 1: [(0, 0)], 2: [(0, 0)]}
    chosen = choose_inplace(steps, [3], {}, {0}, eligible)
    assert chosen == {1: {0: 0}, 2: {0: 0}}          # never into the graph input (step 0)
    # 1 is still read later: not at step 1
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((2, 1), (3,))]
    assert 1 not in choose_inplace(steps, [3], {}, {0}, eligible)
    # 1 may share storage with the input (a reference kernel could return it): never
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((2,), (3,))]
    assert 1 not in choose_inplace(steps, [3], {1: [0]}, {0}, eligible)
    # the step reads the input's storage twice (x and a view of x): never
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((1, 2), (3,))]
    assert 2 not in choose_inplace(steps, [3], {2: [1]}, {0}, {2: [(0, 0), (0, 1)]})
    # a graph output is alive to the end
    steps = [Step((0,), (1,)), Step((1,), (2,))]
    assert choose_inplace(steps, [1, 2], {}, {0}, {1: [(0, 0)]}) == {}


def test_inplace_output_keeps_the_storage_alive() -> None:
    # 2 is written into 1 at step 1, and read at step 3: nothing may be written into 1's group at step 2
    steps = [Step((0,), (1,)), Step((1,), (2,)), Step((0,), (3,)), Step((2, 3), (4,))]
    chosen = choose_inplace(steps, [4], {}, {0}, {1: [(0, 0)], 3: [(0, 0), (0, 1)]})
    assert chosen[1] == {0: 0} and chosen[3] == {0: 0}


# ---- plan.memory on built plans ----

def test_unfused_chain_needs_two_buffers() -> None:
    g = fg.Graph(name="chain", compute_dtype="float32")
    x = g.tensor((64, 128), dtype="float32", name="x")
    y = x
    for op in ("exp", "neg", "abs", "sqrt", "sin", "cos"):   # sqrt of abs: no nan
        y = getattr(g, op)(y)
    y.set_output()
    plan = g.build(fuse=False)
    mem = plan.memory
    nbytes = 64 * 128 * 4
    assert len(plan.kernels) == 6
    assert mem.num_buffers == 5 and mem.no_reuse_bytes == 5 * nbytes
    assert mem.arena_bytes <= 2 * aligned(nbytes)
    assert mem.reused == 3
    assert mem.peak_live_bytes == 2 * nbytes          # one input and one output of a launch at a time
    assert mem.input_bytes == nbytes and mem.output_bytes == nbytes
    assert "memory: 5 intermediate buffer(s)" in str(plan)
    xt = rand(64, 128)
    assert_close(plan(xt), fg.reference(g).execute({x: xt})[y], what="chain")


def test_view_shares_its_base_buffer() -> None:
    g = fg.Graph(name="views", compute_dtype="float32")
    x = g.tensor((8, 32), dtype="float32", name="x")
    e = g.exp(x)
    r = g.reshape(e, (4, 64))
    y = g.neg(r)
    y.set_output()
    plan = g.build(fuse=False)
    mem = plan.memory
    assert [k.ops for k in plan.kernels] == [["exp"], ["reshape"], ["neg"]]
    assert mem.num_buffers == 1 and mem.no_reuse_bytes == 8 * 32 * 4
    (buf,) = [b for b in mem.buffers if not b.output]
    assert len(buf.members) == 2 and (buf.start, buf.end) == (0, 2)   # the view keeps exp's buffer to step 2


def _matmul_then_elementwise() -> tuple[fg.Graph, list[fg.Tensor], list[fg.Tensor]]:
    """m = x @ w is read by a second matmul and, last, by an elementwise kernel writing a graph output:
    that kernel may write into m's buffer, never into x (a graph input it also reads)."""
    g = fg.Graph(name="inplace", compute_dtype="float32")
    x = g.tensor((32, 48), dtype="float32", name="x")
    w = g.tensor((48, 48), dtype="float32", name="w")
    m = g.matmul(x, w)
    b = g.matmul(m, w)
    a = g.mul(g.exp(m), x)
    b.set_output()
    a.set_output()
    return g, [x, w], [b, a]


def test_elementwise_kernel_writes_into_a_dying_intermediate() -> None:
    g, (x, w), (b, a) = _matmul_then_elementwise()
    plan = g.build()
    last = plan.kernels[-1]
    assert last.kind == "pointwise" and isinstance(last.launch, TritonLaunch)
    assert plan.memory.inplace == 1
    assert plan._steps[-1][0].into == (0,) and last.launch.into == ()   # the kernel's own launcher is untouched
    xt, wt = rand(32, 48), rand(48, 48) * 0.2
    x_before, w_before = xt.clone(), wt.clone()
    ref = fg.reference(g).execute({x: xt, w: wt})
    out_b, out_a = plan(xt, wt)
    assert torch.equal(xt, x_before) and torch.equal(wt, w_before)    # graph inputs never written
    assert_close(out_a, ref[a], what="in-place exp*x")
    assert_close(out_b, ref[b], what="matmul")
    # a second call with other values: fresh outputs, the first call's outputs untouched
    kept = out_a.clone()
    _, out_a2 = plan(xt * 0.5, wt)
    assert torch.equal(out_a, kept) and out_a2.data_ptr() != out_a.data_ptr()
    assert_close(out_a2, fg.reference(g).execute({x: xt * 0.5, w: wt})[a], what="second call")
    # the same kernels without in-place: the same values, one more buffer
    plain = Plan(plan.graph, plan.kernels, plan.device, inplace=False)
    assert plain.memory.inplace == 0 and plain.memory.num_buffers == plan.memory.num_buffers + 1
    assert torch.equal(plain(xt, wt)[1], plan(xt, wt)[1])


def test_graph_input_is_never_written_in_place() -> None:
    g = fg.Graph(name="from_input", compute_dtype="float32")
    x = g.tensor((16, 40), dtype="float32", name="x")
    y = g.add(g.exp(x), 1.0)
    y.set_output()
    plan = g.build()
    assert plan.memory.inplace == 0 and all(not getattr(s[0], "into", ()) for s in plan._steps)
    xt = rand(16, 40)
    before = xt.clone()
    assert_close(plan(xt), torch.exp(before) + 1.0, what="exp+1")
    assert torch.equal(xt, before)


def test_cuda_graph_path_untouched_on_cpu() -> None:
    g, (x, w), (b, a) = _matmul_then_elementwise()
    plan = g.build(cuda_graphs=True)
    assert plan.cuda_graph is None and not plan.cuda_graph_captured
    assert plan.memory.inplace == 1
    xt, wt = rand(32, 48), rand(48, 48) * 0.2
    ref = fg.reference(g).execute({x: xt, w: wt})
    out_b, out_a = plan(xt, wt)
    assert_close(out_a, ref[a], what="exp*x")
    assert_close(out_b, ref[b], what="matmul")


def test_view_kernels_alias_their_input() -> None:
    """Kernels of kind "view" (strided aliases, lower.py) have no buffer of their own and keep their
    input's buffer live; a view of a graph input is never written in place."""
    import dataclasses

    g = fg.Graph(name="view_kind", compute_dtype="float32")
    x = g.tensor((8, 32), dtype="float32", name="x")
    r = g.reshape(g.exp(x), (4, 64))
    y = g.neg(r)
    y.set_output()
    built = g.build(fuse=False)
    kernels = [dataclasses.replace(k, kind="view", backend="torch") if k.ops == ["reshape"] else k
               for k in built.kernels]
    plan = Plan(built.graph, kernels, built.device)
    assert plan.memory.num_buffers == 1 and plan.memory.buffers[0].members == (1, 2)
    # the same view taken of the graph input: no buffer at all (the input is resident)
    steps_view_of_input = [Step((0,), (1,)), Step((1,), (2,))]
    mem = plan_memory(steps_view_of_input, {0: 1024, 1: 1024, 2: 1024}, [0], [2], view_of={1: 0})
    assert mem.num_buffers == 0 and [b.slot for b in mem.buffers] == [2]
    assert choose_inplace(steps_view_of_input, [2], {1: [0]}, {0}, {1: [(0, 0)]}) == {}
    xt = rand(8, 32)
    assert_close(plan(xt), -torch.exp(xt).reshape(4, 64), what="view plan")
