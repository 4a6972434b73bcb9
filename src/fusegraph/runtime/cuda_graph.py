"""CUDA graphs: replay a whole static Plan as one captured graph instead of one launch per kernel.

A Plan's kernels launch one by one from Python (host cost LAUNCH_US each). A captured CUDA graph
replays all of them for REPLAY_US + GRAPH_NODE_US per kernel, but reads fixed input buffers and
writes fixed output buffers, so each call copies every input into the captured input buffer (one
copy_ each; its outputs are the captured buffers while the caller drops them, see Outputs below);
each copy is one more launch (COPY_US of host time) and moves its bytes twice (read + write).

The rule (build(cuda_graphs=None), the default) is an explicit estimate of one call's time:

    plain = max(K * LAUNCH_US,                 floor)
    graph = max(REPLAY_US + copies * COPY_US,  floor + K * GRAPH_NODE_US + copy_bytes * 2 / bandwidth)

with K kernels, floor the sum of the kernels' cost-model floors (datasheet spec) and copies = the
inputs not declared static; copy_bytes likewise counts only those. The
Plan is captured when it has two or more kernels and graph < plain:
small, launch-bound plans. Never a one-kernel plan (one launch becomes one replay plus the copies,
each about a launch's cost), never a device-bound plan (the launches hide behind the work and the
copies only add time). cuda_graphs=True captures
whenever it is possible, False never; settings.cuda_graphs=False (FUSEGRAPH_CUDA_GRAPHS=0) turns
capture off everywhere. Not capturable: a Plan not on CUDA, without kernels, with a kernel marked
host_sync (reads a value back), or with an input whose strides overlap (cannot be copied into).
The reason is kept on plan.cuda_graph_note (and printed under FUSEGRAPH_DEBUG >= 1).

The estimate knows the device side (floors) better than the host side: a launch through a library's
Python API (a cuDNN frontend graph, a torch op) costs several times LAUNCH_US on the host, and the
same Python is slower in a process holding millions of objects. So a plan the estimate turns down
(device-bound on paper) measures instead at its second call, the first after the warm-up: the host
time until its launches are queued against the span of the call on the GPU (CUDA events, one
synchronize, once). When the host took at least HOST_BOUND of that span, the GPU was waiting on
the host for most of the call: the plan is captured then (ResNet-50 at batch 128 on the H200: 59
kernels, ~55 of them cuDNN frontend plans, 4.4 ms of kernels but 4.9-6.6 ms of host time per call).
Otherwise it stays kernel by kernel, and the note says so with the numbers.

Outputs (graph_outputs): "copy" (the default) returns outputs the caller owns; "alias" returns the
captured buffers themselves, which the next replay overwrites (the caller's promise to be done with
them); "reuse" returns the captured buffers only while that is safe. A copy plan returns its
outputs as the captured buffers too, as long as the caller drops them before the next call (a use-count
check before each replay, as for reuse): a clone would double a large one (the zoo's small Llama at
batch 2: 125 MiB of logits in the graph's pool plus 125 MiB cloned, eager's whole peak being 130 MiB),
and costs a small one a launch of host time (a decode step's 8 KiB hidden state: a clone took 17 us
of the H200 host's ~110 us per call, bench/decode_host_gpu.py). The first call that finds them still
referenced runs kernel by kernel into fresh memory, and from then on that plan clones every output
after its replay (keeping the check while the caller holds the earlier buffers): a caller that keeps
outputs across calls pays one clone per call, as before.

For training graphs, whose forward returns every
activation the backward saves (gigabytes: cloning them costs as much as the launches saved), a reuse
plan checks before each replay that nothing outside it still references the previous call's outputs (the
storages' use counts are back to what the plan itself holds) and otherwise runs that call kernel by
kernel into fresh memory (correct; e.g. a caller keeping the previous step's gradient tensors, g =
p.grad; zero_grad(set_to_none=False) does not: autograd accumulates into the .grad tensors it kept, made
at the first, uncaptured call). Small outputs (up to SMALL_OUTPUT_BYTES: a loss the caller keeps for
logging) are cloned instead, so holding them costs nothing; except outputs the builder says no caller
keeps (build option held_outputs lists the ones that may be kept: the torch backend leaves out a
training forward's saved activations, which only its backward reads, and every gradient of a backward,
as the large ones), which are tracked like large ones: saved activations are read in place by the
backward, without a clone and a copy each. A reuse plan captures on its second call rather than its
first, so that a plan fed by another reuse plan (a backward reading its forward's saved
activations) sees those captured buffers as its inputs: an input that lies in another reuse plan's
outputs is read in place, like a static input (a call where it is elsewhere runs kernel by kernel),
so no copy is made on either side.

Capture happens on the first call whose inputs match the Plan: that call runs kernel by kernel
(the warm-up: Triton compiles, libraries initialize) and returns its results; then the Plan is run
once more on a side stream and captured there into a private memory pool. A capture that fails
leaves the Plan on the plain path with a CudaGraphWarning; it never raises.

Static inputs (g.tensor(..., static=True), g.tensor_like(t, static=True) or
build(static_inputs=[handle, ...]); weights, buffers) are captured by reference: the graph reads the
memory of the tensor passed at the capture call, so replay copies nothing for them. The rule, checked
on every replay: a static input must be backed by the same memory as at capture, i.e.
`t.data_ptr()` equal to the captured one (the guards already checked shape, strides and dtype), so
the same tensor object, a view of it like t.detach(), or the same tensor updated in place (an
optimizer step) all replay. A call whose static input is somewhere else (another tensor, or
`w.data = ...` moved the storage) is still correct but slower: that call runs kernel by kernel
(the plain path), with a CudaGraphWarning the first time. It is not copied into the captured memory:
that memory is the caller's earlier tensor, which would silently change. The capture keeps the
captured tensors' storage alive.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidValueError
from ..ir.spec import dense_in_order
from ..settings import settings

LAUNCH_US = 20.0      # host time of one kernel launched from Python (12-20 us measured on the H200 host)
REPLAY_US = 5.0       # host time of one CUDAGraph.replay()
GRAPH_NODE_US = 0.6   # device-side gap per kernel inside a replayed graph
COPY_US = 5.0         # host time of one copy_ / clone launch
# a plan the estimate turned down is captured when, measured at its second call, the host's time to
# queue its launches is at least this fraction of the call's span on the GPU (the GPU waited on the host)
HOST_BOUND = 0.8
# graph_outputs="reuse": outputs whose storage is at most this size are cloned rather than returned as
# the captured buffer (a loss kept by `loss = step()` until after the next call would otherwise send
# every call kernel by kernel); larger ones (activations, gradients) are returned and tracked
SMALL_OUTPUT_BYTES = 1 << 16

GRAPH_OUTPUTS = ("copy", "alias", "reuse")

RunFn = Callable[[Sequence[Any]], list[Any]]


class CudaGraphWarning(UserWarning):
    """A Plan's CUDA-graph capture failed; it runs kernel by kernel instead."""


@dataclass(frozen=True)
class GraphDecision:
    capture: bool
    note: str                # why (not), with the numbers of the estimate
    copies: int = 0          # copy_/clone launches per call when captured
    by_estimate: bool = False  # capturable; only the estimate said no (decided again on measurements or at capture)


def log(message: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {message}", file=sys.stderr)


def check_graph_outputs(value: str) -> str:
    if value not in GRAPH_OUTPUTS:
        raise InvalidValueError(f"build option graph_outputs={value!r}: use 'copy' (fresh outputs, the default), "
                                f"'alias' (the captured buffers, valid until the next call) or 'reuse' (the "
                                f"captured buffers while the caller holds none of the previous call's)")
    return value


def decide(requested: bool | None, device: str, kernels: Sequence[Any], inputs: Sequence[Any],
           static_inputs: Collection[int] = ()) -> GraphDecision:
    """Whether a Plan is captured (see the module doc for the rule). `inputs` are the graph's input
    nodes (shape, dtype, memory strides); `kernels` its launch list; `static_inputs` the positions of
    inputs read in place (not copied). The copies counted are the other inputs': no plan clones its
    outputs per call while the caller drops them (a copy plan starts cloning only once a caller keeps
    one across calls)."""
    if requested is False:
        return GraphDecision(False, "off: build(cuda_graphs=False)")
    if not settings.cuda_graphs:
        return GraphDecision(False, "off: settings.cuda_graphs is False (FUSEGRAPH_CUDA_GRAPHS)")
    if torch.device(device).type != "cuda":
        return GraphDecision(False, f"not capturable: the plan runs on {device}, not CUDA")
    if not kernels:
        return GraphDecision(False, "not capturable: the plan launches no kernels")
    syncing = [k.name for k in kernels if getattr(k, "host_sync", False)]
    if syncing:
        return GraphDecision(False, f"not capturable: kernel(s) {', '.join(syncing)} wait for the device "
                                    f"(read a value back)")
    # a gapped input (a saved q viewed out of a fused qkv result, padded rows) is copied into a
    # captured buffer of the same strides; an overlapping one (an expand) cannot be written so
    overlapping = [n.name for n in inputs if not non_overlapping(tuple(n.shape), tuple(n.spec.memory_strides))]
    if overlapping:
        return GraphDecision(False, f"not capturable: input(s) {', '.join(overlapping)} have overlapping "
                                    f"strides (cannot be copied into a captured buffer)")
    copied = [n for i, n in enumerate(inputs) if i not in static_inputs]
    copies = len(copied)
    in_place = f", {len(inputs) - len(copied)} static input(s) read in place" if len(copied) < len(inputs) else ""
    if requested:
        return GraphDecision(True, f"forced: build(cuda_graphs=True); {copies} copies per call{in_place}", copies)
    floor_us, bandwidth = _floor_us(kernels)
    copy_bytes = sum(_nbytes(n) for n in copied)
    k = len(kernels)
    plain = max(k * LAUNCH_US, floor_us)
    graph = max(REPLAY_US + copies * COPY_US, floor_us + k * GRAPH_NODE_US + 2 * copy_bytes / bandwidth * 1e6)
    numbers = (f"{k} kernel(s), floor {floor_us:.1f} us, {copies} copies of {copy_bytes / 1e6:.2f} MB: "
               f"estimated {graph:.1f} us per call as a graph vs {plain:.1f} us kernel by kernel{in_place}")
    if k < 2:
        return GraphDecision(False, f"auto: one kernel, nothing to batch into a graph ({numbers})", copies)
    if graph < plain:
        return GraphDecision(True, f"auto: launch-bound, {numbers}", copies)
    return GraphDecision(False, f"auto: not worth it, {numbers}", copies, by_estimate=True)


def non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no element is stored twice (dense, permuted or with gaps between rows)."""
    return dense_in_order(shape, strides) is not None


def _nbytes(node: Any) -> int:
    n = 1
    for d in node.shape:
        n *= int(d)
    return n * torch.empty((), dtype=_torch_dtype(node.dtype)).element_size()


def _torch_dtype(name: str) -> torch.dtype:
    from ..ir import dtypes
    return dtypes.to_torch(name)


def _floor_us(kernels: Sequence[Any]) -> tuple[float, float]:
    """Sum of the kernels' cost-model floors in us and the datasheet bandwidth (bytes/s); a kernel
    the cost model cannot price counts 0 (which leans towards capture)."""
    from ..tune.autotuner import _datasheet_spec, floor_ms_of

    total = sum((floor_ms_of(k) or 0.0) * 1e3 for k in kernels)
    return total, float(_datasheet_spec().bandwidth)


def stream_capturing() -> bool:
    """True while the current CUDA stream is being captured (by the caller): capturing ours then
    would end theirs (capture synchronizes)."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


@dataclass
class Captured:
    """What replay needs: the graph, the buffers it reads and the buffers it writes. `static_inputs`
    are all the input buffers in order (for a static input: the caller's tensor, detached, read in place);
    `by_reference` the positions of the static inputs."""

    graph: Any
    static_inputs: list[torch.Tensor | None]
    static_outputs: list[torch.Tensor]
    pool: Any
    by_reference: frozenset[int] = frozenset()
    input_ptrs: list[int] = field(default_factory=list)   # each input buffer's address at capture
    # run before every replay: refresh values that launches computed outside the graph and baked into it
    hooks: tuple[Callable[[], None], ...] = ()
    # output storage handle -> its use count when only this capture references it (taken when the
    # first replay function is made, right after capture; a later one, made while a caller holds
    # outputs, checks against the same counts)
    use_counts: dict[int, int] = field(default_factory=dict)
    # (side-stream warm-up, capture) wall seconds, measured under FUSEGRAPH_PROFILE_BUILD (else zeros)
    seconds: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        if not self.input_ptrs:
            self.input_ptrs = [t.data_ptr() if t is not None else 0 for t in self.static_inputs]


# The output storages of captured "reuse" plans (storage address -> its capture): another plan's input
# found here is read in place. Weak: a dropped plan's entries go with it.
_reused_outputs: weakref.WeakValueDictionary[int, Captured] = weakref.WeakValueDictionary()


def reused_output(t: Any) -> bool:
    """Is `t` (a view of) an output buffer of a captured reuse plan that is still alive?"""
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in _reused_outputs


# While capture() records a plan: hooks of launches that baked into the graph a value computed outside it
# (the folded per-channel vectors of a fused cuDNN convolution), to be run before every replay.
_replay_hooks: list[Callable[[], None]] | None = None


def refresh_before_replay(hook: Callable[[], None]) -> bool:
    """For a launch running inside a capture: when fusegraph is recording a plan, keep `hook` (it
    brings a baked value up to date, e.g. recomputes it when its inputs were written in place) to run
    before each replay, and return True: the launch may use its precomputed value. False inside any
    other capture (the caller's own graph would never refresh it): compute the value inside the graph."""
    if _replay_hooks is None:
        return False
    _replay_hooks.append(hook)
    return True


@contextlib.contextmanager
def recording_replay_hooks() -> Iterator[list[Callable[[], None]]]:
    """The hooks registered by refresh_before_replay while the block records a capture."""
    global _replay_hooks
    hooks: list[Callable[[], None]] = []
    saved, _replay_hooks = _replay_hooks, hooks
    try:
        yield hooks
    finally:
        _replay_hooks = saved


def capture(run_plain: RunFn, inputs: Sequence[torch.Tensor], by_reference: Collection[int] = ()) -> Captured:
    """Capture one run of `run_plain` on copies of `inputs` (the inputs themselves, detached, at the
    positions in `by_reference`) as a CUDA graph: a warm-up run on a side stream, then the capture on
    that stream into a private memory pool (as PyTorch requires)."""
    with torch.no_grad():
        return _capture(run_plain, inputs, frozenset(by_reference))


def input_buffers(inputs: Sequence[torch.Tensor], by_reference: frozenset[int]) -> list[torch.Tensor]:
    """The buffers a captured graph reads: a fresh copy of each input, or the input itself (detached:
    it keeps the storage alive and stays out of autograd) for the static ones."""
    return [t.detach() if i in by_reference else
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
            for i, t in enumerate(inputs)]


# One side stream per device for every warm-up and capture: cuBLAS keeps a workspace per (handle,
# stream) for the life of the process (32 MiB on Hopper), so a fresh stream per capture held another
# one per captured plan (the zoo's BERT: 33.5 MiB held, 32 of them that workspace).
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream captures on `device` run on (created at the first capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _capture_streams[index]


def _capture(run_plain: RunFn, inputs: Sequence[torch.Tensor], by_reference: frozenset[int]) -> Captured:
    static_inputs = input_buffers(inputs, by_reference)
    device = static_inputs[0].device if static_inputs else torch.device("cuda")
    current = torch.cuda.current_stream(device)
    side = capture_stream(device)
    side.wait_stream(current)
    start = _profile_clock(device)
    with torch.cuda.stream(side):
        run_plain(static_inputs)
    current.wait_stream(side)
    warmed = _profile_clock(device)
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with recording_replay_hooks() as hooks, torch.cuda.graph(graph, pool=pool, stream=side):
        static_outputs = run_plain(static_inputs)
    current.wait_stream(side)
    done = _profile_clock(device)
    return Captured(graph, list[torch.Tensor | None](static_inputs), list(static_outputs), pool, by_reference,
                    hooks=tuple(hooks), seconds=(warmed - start, done - warmed))


def first_run_summary(kernels: Sequence[tuple[str, float]], top: int = 8) -> str:
    """The first run's launches by kind (the label's last word: its backend) and the slowest ones, as
    the first-call report prints them."""
    by_kind: dict[str, tuple[int, float]] = {}
    for label, seconds in kernels:
        kind = label.rsplit(" ", 1)[-1]
        count, total = by_kind.get(kind, (0, 0.0))
        by_kind[kind] = (count + 1, total + seconds)
    kinds = ", ".join(f"{kind} {total:.3f} s ({count})"
                      for kind, (count, total) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]))
    slowest = ", ".join(f"{label} {seconds:.3f} s" for label, seconds in sorted(kernels, key=lambda ks: -ks[1])[:top])
    return f"  first run by backend: {kinds}\n  slowest first launches: {slowest}"


def _profile_clock(device: torch.device | None = None) -> float:
    """time.perf_counter() after the device's work so far, when builds are profiled
    (settings.profile_build: the first call's phases are reported with the build); 0.0 otherwise."""
    if not settings.profile_build:
        return 0.0
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    return time.perf_counter()


def compile_replay(guard_lines: list[str], env: dict[str, Any], n_in: int, captured: Captured,
                   alias_outputs: bool, name: str, moved: RunFn | None = None,
                   live: RunFn | None = None, plain: RunFn | None = None,
                   held: Collection[int] | None = None, clone_all: bool = False,
                   track_all: bool = False) -> tuple[RunFn, str]:
    """The per-call path of a captured Plan as one generated function: the Plan's input guards
    (`guard_lines`, which bind s0..s{n-1} and send other signatures elsewhere), with `plain` a check
    that the caller is not capturing a CUDA graph of its own (a replay cannot be captured: such a call
    runs kernel by kernel, which the caller's graph records), for the inputs read
    in place a check that each is at its captured address (else the call goes to `moved`), with
    `live` (reuse outputs) a check that the previous call's outputs are no longer referenced (else
    the call goes to `live`), one copy_ per other input into the captured buffers, the replay, and the
    outputs (cloned unless aliased; with `live`, fresh tensor objects on the captured buffers, whose
    references the next call's check counts, except small ones the caller may keep (`held`: their
    positions, None = all), which are cloned, and all of them cloned with `clone_all`, the check
    kept; `track_all` (copy plans): small outputs are tracked like large ones, not cloned, since a
    copy plan that finds one kept switches to `clone_all`). Returns the function and its source."""
    env = dict(env)
    env.update(REPLAY=captured.graph.replay, GRAD_ON=torch.is_grad_enabled, SET_GRAD=torch._C._set_grad_enabled)
    lines = list(guard_lines)
    if plain is not None:
        # one check per call: torch's own query where there is a GPU (the module function elsewhere)
        capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else stream_capturing
        env.update(PLAIN=plain, CAPTURING=capturing)
        lines += ["    if CAPTURING():", "        return PLAIN(inputs)"]
    by_reference = sorted(captured.by_reference)
    if by_reference:
        if moved is None:
            raise ValueError("compile_replay: static inputs need a `moved` path")
        env["MOVED"] = moved
        for i in by_reference:
            env[f"P{i}"] = captured.input_ptrs[i]
        lines += [f"    if {' or '.join(f's{i}.data_ptr() != P{i}' for i in by_reference)}:",
                  "        return MOVED(inputs)"]
    checks = []
    tracked = {id(o) for j, o in enumerate(captured.static_outputs)
               if track_all or _storage_bytes(o) > SMALL_OUTPUT_BYTES or (held is not None and j not in held)}
    if live is not None:
        env.update(LIVE=live, USE=torch._C._storage_Use_Count)
        for j, (cdata, _) in enumerate(output_storages([o for o in captured.static_outputs if id(o) in tracked])):
            env[f"C{j}"] = cdata
            checks.append(j)
        if checks:
            lines += [f"    if {' or '.join(f'USE(C{j}) != B{j}' for j in checks)}:",
                      "        return LIVE(inputs)"]
    # copy_ from an input that requires grad would make the captured buffer part of autograd's graph
    lines += ["    grad = GRAD_ON()", "    if grad:", "        SET_GRAD(False)", "    try:"]
    for i, buf in enumerate(captured.static_inputs):
        if i not in captured.by_reference:
            env[f"I{i}"] = buf
            lines.append(f"        I{i}.copy_(s{i})")
    if captured.hooks:
        env["HOOKS"] = captured.hooks
        lines += ["        for hook in HOOKS:", "            hook()"]
    lines.append("        REPLAY()")
    results = []
    for j, out in enumerate(captured.static_outputs):
        env[f"O{j}"] = out
        if live is not None:   # small outputs (a loss the caller keeps for logging) are cloned, not tracked
            results.append(f"O{j}.detach()" if id(out) in tracked and not clone_all else f"O{j}.clone()")
        else:
            results.append(f"O{j}" if alias_outputs else f"O{j}.clone()")
    lines += [f"        return [{', '.join(results)}]",
              "    finally:", "        if grad:", "            SET_GRAD(True)"]
    source = "\n".join(lines)
    # the baseline use counts: the references this plan itself holds (the captured outputs)
    for j in checks:
        cdata = env[f"C{j}"]
        env[f"B{j}"] = captured.use_counts.setdefault(cdata, torch._C._storage_Use_Count(cdata))
    exec(compile(source, f"<plan {name} cuda graph>", "exec"), env)
    run: RunFn = env["run"]
    return run, source


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def output_storages(outputs: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(storage handle, storage address) of each distinct storage among `outputs`."""
    seen: dict[int, int] = {}
    for t in outputs:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage._cdata)
    return [(cdata, ptr) for ptr, cdata in seen.items()]


def measure_call(run: RunFn, inputs: Sequence[Any]) -> tuple[list[Any], float, float]:
    """Run one call and return (outputs, host seconds until run returned, seconds the call spanned on
    the GPU from its first launch to its last kernel's end). Synchronizes once."""
    import time

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    outs = run(inputs)
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return outs, host, start.elapsed_time(end) / 1e3


class GraphRunner:
    """A Plan's calls while capture is pending: the first matching call runs kernel by kernel, then
    captures (a reuse plan: on the second matching call); from then on the Plan calls the generated
    replay function. `install` swaps the Plan's per-call function; `capture_fn` is `capture` (tests
    put a stand-in here on CPU); `outputs` the graph_outputs mode; `static_inputs` the positions of
    the inputs captured by reference; `input_names` name them in warnings; `held_outputs` (reuse) the
    positions of outputs a caller may keep past the next call (None: any)."""

    def __init__(self, name: str, n_in: int, run_plain: RunFn, matches: Callable[[Sequence[Any]], bool],
                 guard: tuple[list[str], dict[str, Any]], outputs: str, install: Callable[[RunFn], None],
                 set_note: Callable[[str], None], static_inputs: Collection[int] = (),
                 input_names: Sequence[str] = (),
                 redecide: Callable[[frozenset[int]], GraphDecision] | None = None,
                 measure: bool = False, held_outputs: Collection[int] | None = None,
                 timed_run: Callable[[Sequence[Any]], tuple[list[Any], list[tuple[str, float]]]] | None = None
                 ) -> None:
        self.name = name
        self.n_in = n_in
        self.run_plain = run_plain
        self.matches = matches
        self.guard = guard
        self.outputs = outputs
        self.install = install
        self.set_note = set_note
        self.static_inputs = frozenset(static_inputs)
        self.input_names = list(input_names) or [f"#{i}" for i in range(n_in)]
        self.captured: Captured | None = None
        self.replay_source = ""        # the generated per-call function once captured
        self.moved_calls = 0           # calls run kernel by kernel: an input read in place was elsewhere
        self.live_calls = 0            # reuse/copy: calls run kernel by kernel, the previous outputs still referenced
        self.cloning = False           # copy: the caller kept outputs across a call, so every output is cloned
        self.nested_calls = 0          # calls inside the caller's own CUDA-graph capture: kernel by kernel
        self.chained_inputs: frozenset[int] = frozenset()   # reuse: inputs read in another plan's outputs
        self.capture_fn: Callable[[RunFn, Sequence[torch.Tensor], Collection[int]], Captured] = capture
        # a reuse plan under the automatic rule decides again at capture, knowing which inputs it reads in place
        self.redecide = redecide
        self.decided_again = ""
        # a plan the estimate turned down (not reuse): measured at its second call, captured if host-bound
        self.measure = measure
        self.measured: tuple[float, float] | None = None   # (host s, GPU span s) of that call
        # reuse: the outputs a caller may keep past the next call (small ones cloned); None = all
        self.held_outputs = None if held_outputs is None else frozenset(held_outputs)
        self.first_run_s = 0.0         # the first call's kernel-by-kernel run (FUSEGRAPH_PROFILE_BUILD only)
        # under FUSEGRAPH_PROFILE_BUILD the first call runs through `timed_run` (each kernel synchronized and
        # timed): (kernel label, seconds) of each launch go to the first-call report
        self.timed_run = timed_run
        self.first_run_kernels: list[tuple[str, float]] = []

    def moved(self, inputs: Sequence[Any]) -> list[Any]:
        """A call whose input read in place is not at its captured address: run kernel by kernel
        (copying it into the captured memory would change the caller's earlier tensor)."""
        if self.moved_calls == 0 and self.captured is not None:
            names = [self.input_names[i] for i in sorted(self.static_inputs)
                     if inputs[i].data_ptr() != self.captured.input_ptrs[i]]
            if names:
                warnings.warn(f"fusegraph: plan {self.name}: static input(s) {', '.join(names)} are not the "
                              f"tensors captured in the CUDA graph (another tensor, or its storage moved): such "
                              f"calls run kernel by kernel (correct, slower); pass the same tensors, or do not "
                              f"declare them static", CudaGraphWarning, stacklevel=4)
            else:
                log(f"plan {self.name}: an input read in place from another plan's captured outputs is "
                    f"elsewhere this call (that plan ran kernel by kernel): running kernel by kernel")
        self.moved_calls += 1
        return self.run_plain(inputs)

    def live(self, inputs: Sequence[Any]) -> list[Any]:
        """A call while outputs a replay returned as captured buffers are still referenced: kernel by
        kernel, into fresh memory, so that the replay does not overwrite them. A copy plan then clones
        every output from its next replay on (this caller keeps outputs across calls)."""
        if self.live_calls == 0:
            log(f"plan {self.name}: the previous call's outputs are still referenced: running kernel by kernel")
        self.live_calls += 1
        if self.outputs == "copy" and not self.cloning and self.captured is not None:
            self.cloning = True
            log(f"plan {self.name}: graph_outputs='copy': the caller keeps outputs across calls, cloning them "
                f"from now on")
            self.install(self._replay())
        return self.run_plain(inputs)

    def in_callers_capture(self, inputs: Sequence[Any]) -> list[Any]:
        """A call while the caller captures its own CUDA graph (torch.cuda.graph around the compiled
        model): our replay cannot be captured, so the kernels launch one by one into their graph."""
        if self.nested_calls == 0:
            log(f"plan {self.name}: called inside the caller's CUDA-graph capture: kernel by kernel")
        self.nested_calls += 1
        return self.run_plain(inputs)

    def first_call(self, inputs: Sequence[Any]) -> list[Any]:
        if settings.profile_build:    # (only then: this runs per call while signatures do not match)
            device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
            start = _profile_clock(device)
            if self.timed_run is not None and self.matches(inputs):
                outs, self.first_run_kernels = self.timed_run(inputs)
            else:
                outs = self.run_plain(inputs)
            self.first_run_s = _profile_clock(device) - start
        else:
            outs = self.run_plain(inputs)   # the warm-up (or another signature: never captured here)
        if not self.matches(inputs) or stream_capturing():
            self._report_first_call()
            return outs                 # inside the caller's own capture: its graph holds our launches
        if self.outputs == "reuse":
            self.install(self.second_call)
            self._report_first_call()
            return outs
        if self.measure:
            self.install(self.measured_call)
            self._report_first_call()
            return outs
        self.install(self.run_plain)    # whatever happens next, no second attempt
        self._capture(inputs, self.static_inputs)
        return outs

    def measured_call(self, inputs: Sequence[Any]) -> list[Any]:
        """The second call of a plan the estimate turned down: timed (host vs GPU span); captured after
        it when the host was the bottleneck."""
        if not self.matches(inputs) or stream_capturing():
            return self.run_plain(inputs)
        self.install(self.run_plain)
        outs, host, span = measure_call(self.run_plain, inputs)
        self.measured = (host, span)
        numbers = (f"measured at the second call: {host * 1e3:.3f} ms of host time to queue the launches, "
                   f"the call spanned {span * 1e3:.3f} ms on the GPU")
        if host < HOST_BOUND * max(span, 1e-9):
            self.set_note(f"{numbers}: device-bound, kernel by kernel")
            log(f"plan {self.name}: {numbers}: not captured")
            return outs
        self.decided_again = f"{numbers}: host-bound; "
        self._capture(inputs, self.static_inputs)
        return outs

    def second_call(self, inputs: Sequence[Any]) -> list[Any]:
        """A reuse plan's capture: inputs lying in other reuse plans' captured outputs are read in place."""
        if not self.matches(inputs) or stream_capturing():
            return self.run_plain(inputs)
        self.install(self.run_plain)
        self.chained_inputs = frozenset(i for i, t in enumerate(inputs)
                                        if i not in self.static_inputs and reused_output(t))
        if self.redecide is not None:
            decision = self.redecide(self.chained_inputs)
            if not decision.capture:
                self.set_note(f"at capture, with {len(self.chained_inputs)} input(s) read in place from another "
                              f"plan's captured outputs: {decision.note}")
                return self.run_plain(inputs)
            self.decided_again = f"at capture: {decision.note}; "
        replay = self._capture(inputs, self.static_inputs | self.chained_inputs)
        captured = self.captured
        if replay is None or captured is None:
            return self.run_plain(inputs)
        for _, ptr in output_storages(captured.static_outputs):
            _reused_outputs[ptr] = captured
        for i in self.chained_inputs:   # the chained buffers belong to their plan: hold no reference
            captured.static_inputs[i] = None
        return replay(inputs)

    def _report_first_call(self, capture_s: tuple[float, float] | None = None) -> None:
        """Under FUSEGRAPH_PROFILE_BUILD, where the plan's first calls went, beside its build profile
        (stderr): the kernel-by-kernel first run (first launches: cuDNN and cuBLAS plan setup, Triton
        launchers, lazily built candidates), then the capture's side-stream warm-up and the capture."""
        if not settings.profile_build:
            return
        line = f"first calls of plan {self.name}: kernel-by-kernel run {self.first_run_s:.3f} s"
        if capture_s is not None:
            line += f"; capture: side-stream warm-up {capture_s[0]:.3f} s, capture {capture_s[1]:.3f} s"
        print(line, file=sys.stderr)
        if self.first_run_kernels:
            print(first_run_summary(self.first_run_kernels), file=sys.stderr)

    def _replay(self) -> RunFn:
        """The generated per-call function of the captured graph (its source kept on replay_source)."""
        assert self.captured is not None
        replay, self.replay_source = compile_replay(
            self.guard[0], self.guard[1], self.n_in, self.captured, self.outputs == "alias", self.name, self.moved,
            self.live if self.outputs != "alias" else None, self.in_callers_capture, self.held_outputs,
            clone_all=self.cloning, track_all=self.outputs == "copy")
        return replay

    def _capture(self, inputs: Sequence[Any], by_reference: frozenset[int]) -> RunFn | None:
        try:
            self.captured = self.capture_fn(self.run_plain, inputs, by_reference)
            replay = self._replay()
        except Exception as err:  # any capture failure falls back to the plain path, never raises
            self.captured = None
            note = f"capture failed, running kernel by kernel: {type(err).__name__}: {err}"
            self.set_note(note)
            warnings.warn(f"fusegraph: plan {self.name}: CUDA-graph {note}", CudaGraphWarning, stacklevel=4)
            log(f"plan {self.name}: CUDA graph {note}\n{traceback.format_exc()}")
            self._report_first_call()
            return None
        self.install(replay)
        if self.captured is not None:
            self._report_first_call(self.captured.seconds)
        in_place = f", {len(self.static_inputs)} static input(s) read in place" if self.static_inputs else ""
        if self.chained_inputs:
            in_place += f", {len(self.chained_inputs)} input(s) read in place from another plan's captured outputs"
        outputs = {"copy": "outputs are the captured buffers while the caller holds none of the previous call's, "
                           "clones once it does",
                   "alias": "outputs alias the captured buffers",
                   "reuse": "outputs are the captured buffers while the caller holds none of the previous call's"}
        when = "second" if self.outputs == "reuse" else "first"
        self.set_note(f"{self.decided_again}captured: one CUDA graph of the whole plan, replayed after its {when} call "
                      f"({outputs[self.outputs]}{in_place})")
        log(f"plan {self.name}: captured as one CUDA graph")
        return replay
