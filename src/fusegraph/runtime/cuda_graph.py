"""CUDA graphs: replay a whole static Plan as one captured graph instead of one launch per kernel.

A Plan's kernels launch one by one from Python (host cost LAUNCH_US each). A captured CUDA graph
replays all of them for REPLAY_US + GRAPH_NODE_US per kernel, but reads fixed input buffers and
writes fixed output buffers, so each call copies every input into the captured input buffer (one
copy_ each) and, unless graph_outputs="alias", returns a fresh clone of every output (the next
replay overwrites the captured ones); each copy is one more launch (COPY_US of host time) and
moves its bytes twice (read + write).

The rule (build(cuda_graphs=None), the default) is an explicit estimate of one call's time:

    plain = max(K * LAUNCH_US,                 floor)
    graph = max(REPLAY_US + copies * COPY_US,  floor + K * GRAPH_NODE_US + copy_bytes * 2 / bandwidth)

with K kernels, floor the sum of the kernels' cost-model floors (datasheet spec) and copies = the
inputs not declared static (+ outputs unless aliased); copy_bytes likewise counts only those. The
Plan is captured when it has two or more kernels and graph < plain:
small, launch-bound plans. Never a one-kernel plan (one launch becomes one replay plus the copies,
each about a launch's cost), never a device-bound plan (the launches hide behind the work and the
copies only add time). cuda_graphs=True captures
whenever it is possible, False never; settings.cuda_graphs=False (FUSEGRAPH_CUDA_GRAPHS=0) turns
capture off everywhere. Not capturable: a Plan not on CUDA, without kernels, with a kernel marked
host_sync (reads a value back), or with an input whose strides overlap (cannot be copied into).
The reason is kept on plan.cuda_graph_note (and printed under FUSEGRAPH_DEBUG >= 1).

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

import sys
import traceback
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidValueError
from ..settings import settings

LAUNCH_US = 20.0      # host time of one kernel launched from Python (12-20 us measured on the H200 host)
REPLAY_US = 5.0       # host time of one CUDAGraph.replay()
GRAPH_NODE_US = 0.6   # device-side gap per kernel inside a replayed graph
COPY_US = 5.0         # host time of one copy_ / clone launch

GRAPH_OUTPUTS = ("copy", "alias")

RunFn = Callable[[Sequence[Any]], list[Any]]


class CudaGraphWarning(UserWarning):
    """A Plan's CUDA-graph capture failed; it runs kernel by kernel instead."""


@dataclass(frozen=True)
class GraphDecision:
    capture: bool
    note: str                # why (not), with the numbers of the estimate
    copies: int = 0          # copy_/clone launches per call when captured


def log(message: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {message}", file=sys.stderr)


def check_graph_outputs(value: str) -> str:
    if value not in GRAPH_OUTPUTS:
        raise InvalidValueError(f"build option graph_outputs={value!r}: use 'copy' (fresh outputs, the default) "
                                f"or 'alias' (the captured buffers, valid until the next call)")
    return value


def decide(requested: bool | None, device: str, kernels: Sequence[Any], inputs: Sequence[Any],
           outputs: Sequence[Any], alias_outputs: bool = False,
           static_inputs: Collection[int] = ()) -> GraphDecision:
    """Whether a Plan is captured (see the module doc for the rule). `inputs`/`outputs` are the
    graph's input and output nodes (shape, dtype, memory strides); `kernels` its launch list;
    `static_inputs` the positions of inputs read in place (not copied)."""
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
    overlapping = [n.name for n in inputs if not dense_strides(tuple(n.shape), tuple(n.spec.memory_strides))]
    if overlapping:
        return GraphDecision(False, f"not capturable: input(s) {', '.join(overlapping)} have overlapping or "
                                    f"gapped strides (cannot be copied into a captured buffer)")
    copied = [n for i, n in enumerate(inputs) if i not in static_inputs]
    copies = len(copied) + (0 if alias_outputs else len(outputs))
    in_place = f", {len(inputs) - len(copied)} static input(s) read in place" if len(copied) < len(inputs) else ""
    if requested:
        return GraphDecision(True, f"forced: build(cuda_graphs=True); {copies} copies per call{in_place}", copies)
    floor_us, bandwidth = _floor_us(kernels)
    copy_bytes = sum(_nbytes(n) for n in copied) + (0 if alias_outputs else sum(_nbytes(n) for n in outputs))
    k = len(kernels)
    plain = max(k * LAUNCH_US, floor_us)
    graph = max(REPLAY_US + copies * COPY_US, floor_us + k * GRAPH_NODE_US + 2 * copy_bytes / bandwidth * 1e6)
    numbers = (f"{k} kernel(s), floor {floor_us:.1f} us, {copies} copies of {copy_bytes / 1e6:.2f} MB: "
               f"estimated {graph:.1f} us per call as a graph vs {plain:.1f} us kernel by kernel{in_place}")
    if k < 2:
        return GraphDecision(False, f"auto: one kernel, nothing to batch into a graph ({numbers})", copies)
    if graph < plain:
        return GraphDecision(True, f"auto: launch-bound, {numbers}", copies)
    return GraphDecision(False, f"auto: not worth it, {numbers}", copies)


def dense_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the strides are a permutation of dense strides (no element stored twice, no gaps)."""
    dims = sorted((s, n) for s, n in zip(strides, shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


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
    static_inputs: list[torch.Tensor]
    static_outputs: list[torch.Tensor]
    pool: Any
    by_reference: frozenset[int] = frozenset()


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


def _capture(run_plain: RunFn, inputs: Sequence[torch.Tensor], by_reference: frozenset[int]) -> Captured:
    static_inputs = input_buffers(inputs, by_reference)
    device = static_inputs[0].device if static_inputs else torch.device("cuda")
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        run_plain(static_inputs)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        static_outputs = run_plain(static_inputs)
    current.wait_stream(side)
    return Captured(graph, static_inputs, list(static_outputs), pool, by_reference)


def compile_replay(guard_lines: list[str], env: dict[str, Any], n_in: int, captured: Captured,
                   alias_outputs: bool, name: str, moved: RunFn | None = None) -> tuple[RunFn, str]:
    """The per-call path of a captured Plan as one generated function: the Plan's input guards
    (`guard_lines`, which bind s0..s{n-1} and send other signatures elsewhere), for the static inputs
    a check that each is at its captured address (else the call goes to `moved`), one copy_ per other
    input into the captured buffers, the replay, and the outputs (cloned unless aliased). Returns
    the function and its source."""
    env = dict(env)
    env.update(REPLAY=captured.graph.replay, GRAD_ON=torch.is_grad_enabled, SET_GRAD=torch._C._set_grad_enabled)
    lines = list(guard_lines)
    by_reference = sorted(captured.by_reference)
    if by_reference:
        if moved is None:
            raise ValueError("compile_replay: static inputs need a `moved` path")
        env["MOVED"] = moved
        for i in by_reference:
            env[f"P{i}"] = captured.static_inputs[i].data_ptr()
        lines += [f"    if {' or '.join(f's{i}.data_ptr() != P{i}' for i in by_reference)}:",
                  "        return MOVED(inputs)"]
    # copy_ from an input that requires grad would make the captured buffer part of autograd's graph
    lines += ["    grad = GRAD_ON()", "    if grad:", "        SET_GRAD(False)", "    try:"]
    for i, buf in enumerate(captured.static_inputs):
        env[f"I{i}"] = buf
        if i not in captured.by_reference:
            lines.append(f"        I{i}.copy_(s{i})")
    lines.append("        REPLAY()")
    results = []
    for j, out in enumerate(captured.static_outputs):
        env[f"O{j}"] = out
        results.append(f"O{j}" if alias_outputs else f"O{j}.clone()")
    lines += [f"        return [{', '.join(results)}]",
              "    finally:", "        if grad:", "            SET_GRAD(True)"]
    source = "\n".join(lines)
    exec(compile(source, f"<plan {name} cuda graph>", "exec"), env)
    run: RunFn = env["run"]
    return run, source


class GraphRunner:
    """A Plan's calls while capture is pending: the first matching call runs kernel by kernel, then
    captures; from then on the Plan calls the generated replay function. `install` swaps the Plan's
    per-call function; `capture_fn` is `capture` (tests put a stand-in here on CPU); `static_inputs`
    the positions of the inputs captured by reference; `input_names` name them in warnings."""

    def __init__(self, name: str, n_in: int, run_plain: RunFn, matches: Callable[[Sequence[Any]], bool],
                 guard: tuple[list[str], dict[str, Any]], alias_outputs: bool, install: Callable[[RunFn], None],
                 set_note: Callable[[str], None], static_inputs: Collection[int] = (),
                 input_names: Sequence[str] = ()) -> None:
        self.name = name
        self.n_in = n_in
        self.run_plain = run_plain
        self.matches = matches
        self.guard = guard
        self.alias_outputs = alias_outputs
        self.install = install
        self.set_note = set_note
        self.static_inputs = frozenset(static_inputs)
        self.input_names = list(input_names) or [f"#{i}" for i in range(n_in)]
        self.captured: Captured | None = None
        self.replay_source = ""        # the generated per-call function once captured
        self.moved_calls = 0           # calls run kernel by kernel: a static input was not the captured one
        self.capture_fn: Callable[[RunFn, Sequence[torch.Tensor], Collection[int]], Captured] = capture

    def moved(self, inputs: Sequence[Any]) -> list[Any]:
        """A call whose static input is not at its captured address: run kernel by kernel (copying it
        into the captured memory would change the caller's earlier tensor)."""
        if self.moved_calls == 0 and self.captured is not None:
            names = [self.input_names[i] for i in sorted(self.static_inputs)
                     if inputs[i].data_ptr() != self.captured.static_inputs[i].data_ptr()]
            warnings.warn(f"fusegraph: plan {self.name}: static input(s) {', '.join(names)} are not the tensors "
                          f"captured in the CUDA graph (another tensor, or its storage moved): such calls run "
                          f"kernel by kernel (correct, slower); pass the same tensors, or do not declare them "
                          f"static", CudaGraphWarning, stacklevel=4)
        self.moved_calls += 1
        return self.run_plain(inputs)

    def first_call(self, inputs: Sequence[Any]) -> list[Any]:
        outs = self.run_plain(inputs)   # the warm-up (or another signature: never captured here)
        if not self.matches(inputs) or stream_capturing():
            return outs                 # inside the caller's own capture: its graph holds our launches
        self.install(self.run_plain)    # whatever happens next, no second attempt
        try:
            self.captured = self.capture_fn(self.run_plain, inputs, self.static_inputs)
            replay, self.replay_source = compile_replay(self.guard[0], self.guard[1], self.n_in, self.captured,
                                                        self.alias_outputs, self.name, self.moved)
        except Exception as err:  # any capture failure falls back to the plain path, never raises
            self.captured = None
            note = f"capture failed, running kernel by kernel: {type(err).__name__}: {err}"
            self.set_note(note)
            warnings.warn(f"fusegraph: plan {self.name}: CUDA-graph {note}", CudaGraphWarning, stacklevel=3)
            log(f"plan {self.name}: CUDA graph {note}\n{traceback.format_exc()}")
            return outs
        self.install(replay)
        in_place = f", {len(self.static_inputs)} static input(s) read in place" if self.static_inputs else ""
        self.set_note(f"captured: one CUDA graph of the whole plan, replayed from the second call "
                      f"({'outputs alias the captured buffers' if self.alias_outputs else 'outputs cloned'}"
                      f"{in_place})")
        log(f"plan {self.name}: captured as one CUDA graph")
        return outs
