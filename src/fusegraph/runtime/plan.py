"""Plan: the compiled, runnable form of a graph. A launch list of Kernels over a buffer table.

Per call, the Plan does the input checks and one launch per kernel; which buffer each kernel
reads and writes is decided at build time (slot indices), not looked up per call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ExecutionError, where
from ..ir import dtypes
from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.printer import format_plan
from ..ir.registry import Cost
from ..ir.spec import TensorSpec, contiguous_strides
from ..settings import settings
from .cuda_graph import GraphDecision, GraphRunner, check_graph_outputs, decide, log
from .guards import FastInputCheck, check_inputs, resolve_feeds
from .kernel import Kernel
from .launch import TritonLaunch
from .memory import MemoryPlan, plan_schedule


class Plan:
    def __init__(self, graph: Graph, kernels: list[Kernel], device: str,
                 input_handles: Sequence[Any] = (), output_handles: Sequence[Any] = (), *,
                 static: bool = False, rebuild: Callable[[Sequence[TensorSpec]], Plan] | None = None,
                 cuda_graphs: bool | None = None, graph_outputs: str = "copy",
                 static_inputs: Sequence[int] = (), inplace: bool = True,
                 held_outputs: Sequence[int] | None = None) -> None:
        self.graph = graph
        self.kernels = kernels
        self.device = device
        self.static = static
        self.input_handles = list(input_handles) or list(graph.inputs)
        self.output_handles = list(output_handles) or list(graph.outputs)
        self._schedule = self._assign_slots()
        # the memory plan; elementwise kernels whose input dies there write into it (runtime/memory.py)
        self._launches: dict[int, Any] = {}
        self.memory = self._plan_memory(inplace)
        self.kernels = self._with_inplace_scatters(self.kernels)
        self._rebuild = rebuild
        self._variants: dict[tuple[Any, ...], Plan] = {}
        # what the fast input check compares: (shape, strides, dtype) per input, and the device kind
        self._expect = tuple((torch.Size(n.shape), n.spec.memory_strides, dtypes.to_torch(n.dtype))
                             for n in graph.inputs)
        self._cuda = torch.device(device).type == "cuda"
        self._fast_check = FastInputCheck()   # the C++ guard in front of those checks, armed at the first call
        self._steps = tuple((self._launches.get(step, k.launch), ins, outs, frees)
                            for step, (k, ins, outs, frees) in enumerate(self._with_frees()))
        self._run_fast = self._compile_run()
        # inputs a CUDA graph reads in place instead of copying (weights; runtime/cuda_graph.py)
        self.static_inputs = tuple(sorted(set(static_inputs)))
        # graph_outputs="reuse": the outputs a caller may keep past the next call (None: any of them)
        self.held_outputs = None if held_outputs is None else tuple(sorted(set(held_outputs)))
        self._setup_cuda_graph(cuda_graphs, check_graph_outputs(graph_outputs))

    def _setup_cuda_graph(self, requested: bool | None, outputs: str) -> None:
        """Decide whether this plan is replayed as one CUDA graph (runtime/cuda_graph.py has the
        rule); when it is, the first matching call runs kernel by kernel and then captures."""
        self.graph_outputs = outputs
        decision = decide(requested, self.device, self.kernels, self.graph.inputs, static_inputs=self.static_inputs)
        self.cuda_graph_note = decision.note
        self.cuda_graph_copies = decision.copies if decision.capture else 0
        self.cuda_graph: GraphRunner | None = None
        log(f"plan {self.graph.name}: CUDA graph: {decision.note}")
        # a plan the estimate turned down may still capture: a reuse plan decides again at its second call,
        # knowing which inputs are another plan's captured outputs (read in place, not copied; a forced one
        # only recounts its copies there); any other plan is measured at its second call (captured if host-bound)
        deferred = requested is None and decision.by_estimate
        if not decision.capture and not deferred:
            return
        plain = self._run_fast
        copies_when_captured = [decision.copies]

        def install(run: Callable[[Sequence[Any]], list[Any]]) -> None:
            self._run_fast = run

        def set_note(note: str) -> None:   # the runner's outcome: captured, or kernel by kernel from now on
            self.cuda_graph_note = f"{decision.note}; {note}"
            self.cuda_graph_copies = copies_when_captured[0] if self.cuda_graph_captured else 0

        def redecide(chained: frozenset[int]) -> GraphDecision:
            again = decide(requested, self.device, self.kernels, self.graph.inputs,
                           static_inputs=set(self.static_inputs) | chained)
            copies_when_captured[0] = again.copies
            self.cuda_graph_copies = again.copies if again.capture else 0
            return again

        self.cuda_graph = GraphRunner(self.graph.name, len(self._expect), plain, self._matches, self._guard_source(),
                                      outputs, install, set_note, self.static_inputs,
                                      [n.name for n in self.graph.inputs],
                                      redecide if outputs == "reuse" else None,
                                      measure=deferred and outputs != "reuse", held_outputs=self.held_outputs,
                                      timed_run=self.run_timed)
        self._run_fast = self.cuda_graph.first_call

    @property
    def cuda_graph_captured(self) -> bool:
        """True once this plan replays a captured CUDA graph."""
        return self.cuda_graph is not None and self.cuda_graph.captured is not None

    def _compile_run(self) -> Callable[[Sequence[Any]], list[Any]]:
        """The per-call path as one generated Python function: unpack, compare each input's
        (shape, dtype, device kind, strides) with what the plan was built for, one call per kernel
        with its buffers as locals, return the outputs (copied where they are inputs or repeat)."""
        n_in = len(self._expect)
        lines, env = self._guard_source()
        env = dict(env)
        ranges = settings.profile_ranges
        if ranges:
            env["RANGE"] = torch.profiler.record_function
        for k, (launch, ins, outs, frees) in enumerate(self._steps):
            env[f"L{k}"] = launch
            args = "".join(f"s{i}, " for i in ins)
            call = f"{''.join(f's{o}, ' for o in outs)}= L{k}(({args}))"
            if ranges:
                kernel = self._schedule[k][0]
                lines += [f"    with RANGE({f'fg:{kernel.kind}:{kernel.name}'!r}):", f"        {call}"]
            else:
                lines.append(f"    {call}")
            lines += [f"    s{i} = None" for i in frees]
        seen: set[int] = {o for kernel, _, outs in self._schedule if kernel.kind == "constant" for o in outs}
        results = []   # inputs, repeated outputs and build-time constants are copied
        for slot in self._out_slots:
            results.append(f"s{slot}.clone()" if slot < n_in or slot in seen else f"s{slot}")
            seen.add(slot)
        if ranges and any(r.endswith(".clone()") for r in results):
            lines += ["    with RANGE('fg:glue:plan output copies'):", f"        outs = [{', '.join(results)}]",
                      "    return outs"]
        else:
            lines.append(f"    return [{', '.join(results)}]")
        exec(compile("\n".join(lines), f"<plan {self.graph.name}>", "exec"), env)
        run: Callable[[Sequence[Any]], list[Any]] = env["run"]
        return run

    def _guard_source(self) -> tuple[list[str], dict[str, Any]]:
        """The generated function's head: `def run(inputs):`, the input checks binding s0..s{n-1},
        and inputs of another signature sent to _other_signature (shared with the CUDA-graph replay)."""
        n_in = len(self._expect)
        env: dict[str, Any] = {"other": self._other_signature, "CUDA": self._cuda, "FAST": self._fast_check}
        lines = ["def run(inputs):", f"    if len(inputs) != {n_in}:", "        return other(inputs)"]
        if n_in:
            lines.append(f"    {', '.join(f's{i}' for i in range(n_in))}, = inputs")
            checks = []
            for i, (shape, strides, dtype) in enumerate(self._expect):
                env[f"S{i}"], env[f"T{i}"], env[f"D{i}"] = shape, strides, dtype
                checks.append(f"s{i}.shape != S{i} or s{i}.dtype is not D{i} or s{i}.is_cuda is not CUDA "
                              f"or s{i}.stride() != T{i}")
            # the C++ guard first (runtime/guards.FastInputCheck); what it rejects, the Python checks judge
            lines += ["    try:", "        fast = FAST.check(*inputs)", "    except TypeError:", "        fast = False",
                      "    if not fast:", "        try:", f"            if {' or '.join(checks)}:",
                      "                return other(inputs)", "        except AttributeError:",
                      "            return other(inputs)", "        if not FAST.armed:", "            FAST.arm(inputs)"]
        return lines, env

    def _with_frees(self) -> list[tuple[Kernel, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """Each step also lists the slots whose last reader it is (dropped after it, not outputs),
        and its own outputs that nothing reads (dropped at once)."""
        last: dict[int, int] = {}
        for step, (_, ins, outs) in enumerate(self._schedule):
            for i in (*outs, *ins):
                last[i] = step
        keep = set(self._out_slots) | set(range(len(self.graph.inputs)))
        return [(k, ins, outs, tuple(sorted(i for i in {*ins, *outs} if last[i] == step and i not in keep)))
                for step, (k, ins, outs) in enumerate(self._schedule)]

    def _plan_memory(self, inplace: bool) -> MemoryPlan:
        """Liveness and arena offsets of the schedule's buffers; with `inplace`, the launchers of
        eligible elementwise kernels are replaced by ones writing into a dying input."""
        return plan_schedule(self._schedule, self.graph.inputs, self._out_slots,
                             self._launches if inplace else None)

    def _with_inplace_scatters(self, kernels: list[Kernel]) -> list[Kernel]:
        """The kernel list with each scatter the memory plan writes into its destination replaced by
        that launcher, its cost without the destination's copy (what plan.explain() times and floors).
        A new list: the caller's kernels are not changed."""
        out = list(kernels)
        for step, launch in self._launches.items():
            k = out[step]
            if isinstance(k.launch, TritonLaunch) or k.backend != "reference":
                continue
            dest = k.inputs[0].spec
            out[step] = dataclasses.replace(
                k, launch=launch, cost=Cost(max(0, k.cost.bytes - 2 * dest.nbytes), k.cost.flops),
                source=k.source + " (in place: writes into its destination, which dies here)",
                note=(k.note + "; " if k.note else "") + "in place: no copy of the destination")
        return out

    def _assign_slots(self) -> list[tuple[Kernel, tuple[int, ...], tuple[int, ...]]]:
        """Give every value a slot: inputs first, then each kernel's outputs in launch order."""
        slot: dict[int, int] = {n.id: k for k, n in enumerate(self.graph.inputs)}
        schedule = []
        for kernel in self.kernels:
            ins = tuple(slot[n.id] for n in kernel.inputs)
            outs = []
            for n in kernel.outputs:
                slot[n.id] = len(slot)
                outs.append(slot[n.id])
            schedule.append((kernel, ins, tuple(outs)))
        self._num_slots = len(slot)
        self._out_slots = tuple(slot[n.id] for n in self.graph.outputs)
        return schedule

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Execute on positional inputs; returns outputs in set_output order."""
        return self._run_fast(inputs)

    def run_slow(self, inputs: Sequence[torch.Tensor],
                 times: list[tuple[str, float]] | None = None) -> list[torch.Tensor]:
        """The same as run(), interpreted step by step (what _compile_run generates). With `times`,
        each launch is synchronized and timed (wall seconds, the device's work included) and
        (kernel name and backend, seconds) appended: FUSEGRAPH_PROFILE_BUILD's first-call report,
        where a first launch pays its library setup and module loading."""
        if not self._matches(inputs):
            return self._other_signature(inputs)
        sync = torch.cuda.synchronize if times is not None and self._cuda and torch.cuda.is_available() \
            else (lambda: None)
        buf: list[Any] = list(inputs)
        buf.extend([None] * (self._num_slots - len(buf)))
        for (launch, ins, outs, frees), (kernel, _, _) in zip(self._steps, self._schedule, strict=True):
            if times is not None:
                sync()
                start = time.perf_counter()
            results = launch([buf[i] for i in ins])
            if times is not None:
                sync()
                label = f"{kernel.name}{_first_run_detail(kernel)} {kernel.backend}"
                times.append((label, time.perf_counter() - start))
            for k, r in zip(outs, results, strict=True):
                buf[k] = r
            for i in frees:
                buf[i] = None
        return fresh_outputs([buf[k] for k in self._out_slots], self._out_slots, len(inputs))

    def run_timed(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[str, float]]]:
        """run_slow with each launch timed: the outputs and the launches' (label, seconds)."""
        times: list[tuple[str, float]] = []
        return self.run_slow(inputs, times), times

    def _matches(self, inputs: Sequence[Any]) -> bool:
        if len(inputs) != len(self._expect):
            return False
        cuda = self._cuda
        try:
            for t, (shape, strides, dtype) in zip(inputs, self._expect, strict=True):
                if t.shape != shape or t.dtype != dtype or t.is_cuda != cuda or t.stride() != strides:
                    return False
        except AttributeError:  # not a tensor
            return False
        return True

    def _other_signature(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """Inputs that differ from what this plan was built for: rebuild for their signature
        (cached), or raise ExecutionError naming the input (static plans, bad feeds)."""
        nodes = self.graph.inputs
        if self.static or self._rebuild is None:
            check_inputs(nodes, inputs, self.device)  # raises on shape, dtype, device, type
            dense = [t.contiguous() for t in inputs]  # only the strides differed
            if self._matches(dense):
                return self.run(dense)
            raise ExecutionError(f"static plan: inputs with strides {[t.stride() for t in inputs]} do not "
                                 f"fit the plan's {[e[1] for e in self._expect]}")
        if len(inputs) != len(nodes) or not all(isinstance(t, torch.Tensor) for t in inputs):
            check_inputs(nodes, inputs, self.device)
        for node, t in zip(nodes, inputs, strict=True):
            if t.device.type != torch.device(self.device).type:
                raise ExecutionError(f"{where('input', node.name, node.source)}: expected a tensor on "
                                     f"{self.device}, got one on {t.device}")
        signature = tuple((tuple(t.shape), t.stride(), t.dtype) for t in inputs)
        plan = self._variants.get(signature)
        if plan is None:
            specs = [_spec_of(t) for t in inputs]
            plan = self._rebuild(specs)
            self._variants[signature] = plan
        return plan.run(inputs)

    def execute(self, feeds: Mapping[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        outs = self.run(resolve_feeds(self.graph.inputs, feeds))
        return dict(zip(self.output_handles, outs, strict=True))

    def __call__(self, *tensors: torch.Tensor) -> Any:
        outs = self._run_fast(tensors)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def variants(self) -> int:
        """How many other input signatures this plan was rebuilt for."""
        return len(self._variants)

    def explain(self) -> str:
        from ..perf.explain import explain_plan

        return f"{explain_plan(self)}\n{self.memory.summary()}"

    def __str__(self) -> str:
        return f"{format_plan(self)}\n  {self.memory.summary()}"

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes


def _spec_of(t: torch.Tensor) -> TensorSpec:
    shape = tuple(t.shape)
    strides = tuple(t.stride())
    dense = strides == contiguous_strides(shape)
    return TensorSpec(shape, dtypes.canonical(t.dtype), layout=None if dense else "strided",
                      strides=None if dense else strides)


def fresh_outputs(values: list[Any], keys: Sequence[int], num_inputs: int) -> list[Any]:
    """Outputs never alias the user's inputs (x * 1 simplifies to x) or each other (CSE merges equal
    outputs): such values are copied. keys[i] identifies values[i]; keys below num_inputs are inputs."""
    seen: set[int] = set()
    out = []
    for key, value in zip(keys, values, strict=True):
        out.append(value.clone() if key < num_inputs or key in seen else value)
        seen.add(key)
    return out


def _first_run_detail(kernel: Any) -> str:
    """What a first-run report names beside a kernel: its chosen library candidate and, for a
    grouped convolution, its groups (the slow first launches are library plan set-up)."""
    candidate = (kernel.config or {}).get("candidate") if isinstance(kernel.config, dict) else None
    groups = next((int(n.attrs.get("groups", 1)) for n in kernel.nodes if n.op.startswith("conv2d")), 1)
    return (f"[{candidate}]" if candidate else "") + (f"[groups={groups}]" if groups > 1 else "")
