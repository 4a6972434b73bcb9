"""Split an ATen FX graph into fusegraph partitions and eager nodes; compile each partition to a Plan.

Nodes whose op has a translator (and whose call it supports) are grouped by torch's
CapabilityBasedPartitioner into connected subgraphs; each becomes a CompiledPartition: a fusegraph
Plan when the translation and build succeed, else the partition's own FX code run by torch (with a
warning). Everything else stays in the outer FX graph and runs eagerly.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ..api import Graph, Tensor
from ..ir import dtypes
from ..ir.spec import contiguous_strides, dense_in_order, same_strides
from ..settings import settings
from .input_mutation import (
    INPLACE_IR_OPS,
    Mutation,
    mutated_placeholders,
    order_write_backs,
    reinplace_input_mutations,
    write_back_input,
)
from .torch_ops import SUPPORTS, Ctx, lookup, translate_node
from .torch_ops_nn import RNG_ARGS, RNG_OUTPUTS

aten = torch.ops.aten

# Partitions made only of these do no arithmetic: leave them to torch (a view costs nothing there).
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
            aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.permute.default, aten.transpose.int,
            aten.t.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.alias.default,
            aten.detach.default, aten.clone.default, operator.getitem}


class FallbackWarning(UserWarning):
    """Part of a model runs eagerly in torch instead of through fusegraph."""


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _value_problem(val: Any) -> str | None:
    """Why a fake value cannot be described to fusegraph (symbolic shape, unknown dtype, device)."""
    if val is None:
        return None
    if isinstance(val, list | tuple):
        for v in val:
            problem = _value_problem(v)
            if problem:
                return problem
        return None
    if not isinstance(val, torch.Tensor):
        return None if isinstance(val, bool | int | float) else f"a value of type {type(val).__name__}"
    if any(not isinstance(s, int) for s in val.shape):
        return f"symbolic shape {tuple(val.shape)} (compile with dynamic=False)"
    if val.layout != torch.strided:
        return f"layout {val.layout}"
    if val.device.type not in ("cpu", "cuda"):
        return f"device {val.device}"
    try:
        dtypes.canonical(val.dtype)
    except Exception:
        return f"dtype {val.dtype}"
    return None


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """None when fusegraph can compile this FX node, else why not (shown by fg.explain)."""
    if node.op != "call_function":
        return f"FX {node.op}"
    if write_back_input(node) is not None:
        return "write-back of a mutated graph input (copy_ in torch at the end of the graph)"
    if node.target is operator.getitem:
        src = node.args[0]
        return unsupported_reason(src) if isinstance(src, torch.fx.Node) else "getitem of a non-node"
    if lookup(node.target) is None:
        return "no translator for this ATen op"
    problem = _value_problem(_own_vals(node))
    for arg in node.all_input_nodes:
        problem = problem or (None if is_rng_state(arg) else _value_problem(arg.meta.get("val")))
    if problem:
        return problem
    devices = {v.device.type for v in _tensor_vals(node)}
    if len(devices) > 1 and not _host_to_device_copy(node):
        return f"tensors on several devices ({', '.join(sorted(devices))}), e.g. a CPU scalar tensor"
    check = SUPPORTS.get(node.target)
    return check(node) if check is not None else None


DEVICE_TRANSFERS = (aten.copy.default, aten._to_copy.default)


def _host_to_device_copy(node: torch.fx.Node) -> bool:
    """A copy onto an accelerator whose CPU operands are graph inputs, graph-owned tensors or 0-dim
    values (torchvision's swin_t fills slices of a CUDA attention mask from CPU scalar tensors): the
    partition moves CPU inputs to its device per call (graph-owned ones become constants on it at
    build; a 0-dim value computed in the partition is computed on its device), so the copy is an
    ordinary on-device copy inside the Plan."""
    own = node.meta.get("val")
    if node.target not in DEVICE_TRANSFERS or not isinstance(own, torch.Tensor) or own.device.type == "cpu":
        return False
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() > 0 and \
                arg.op not in ("placeholder", "get_attr"):
            return False
    return True


def _own_vals(node: torch.fx.Node) -> Any:
    """The node's fake value(s), without the attention RNG state outputs (None in their place)."""
    val = node.meta.get("val")
    skip = RNG_OUTPUTS.get(node.target, ())
    if not skip or not isinstance(val, list | tuple):
        return val
    return [None if i in skip else v for i, v in enumerate(val)]


def is_rng_state(node: torch.fx.Node) -> bool:
    """An attention op's philox seed/offset (an output of the forward, or a value that only goes to
    the RNG arguments of attention backwards). Without dropout nothing reads it: it is traced on the
    CPU or the meta device, kept out of Plans, and handed on as a zero placeholder."""
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and node.args[1] in RNG_OUTPUTS.get(src.target, ())
    if not node.users:
        return False
    for user in node.users:
        positions = RNG_ARGS.get(user.target)
        if positions is None or node in user.kwargs.values():
            return False
        if any(a is node for i, a in enumerate(user.args) if i not in positions):
            return False
    return True


def _tensor_vals(node: torch.fx.Node) -> list[torch.Tensor]:
    vals = [_own_vals(node)] + [a.meta.get("val") for a in node.all_input_nodes if not is_rng_state(a)]
    flat: list[torch.Tensor] = []
    for v in vals:
        items = v if isinstance(v, list | tuple) else [v]
        flat.extend(t for t in items if isinstance(t, torch.Tensor))
    return flat


class _Support(OperatorSupportBase):
    def __init__(self) -> None:
        self.reasons: dict[torch.fx.Node, str] = {}

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        reason = unsupported_reason(node)
        if reason is not None and node.op == "call_function":
            self.reasons[node] = reason
        return reason is None


@dataclass
class PartitionRecord:
    """What happened to one partition: compiled by fusegraph, or run eagerly (and why)."""

    name: str
    ops: Counter[str]
    status: str = "pending"          # "fusegraph" or "eager"
    reason: str = ""
    kernels: int = 0
    # one line per Plan kernel: "kind/backend: op+op+..." (fg.explain, bench/torch_backend_gpu.py)
    kernel_ops: list[str] = field(default_factory=list)
    views: int = 0                      # view kernels (strided aliases, no launch), not in kernel_ops
    plan_ref: Any = field(default=None, repr=False, compare=False)  # weakref to the Plan (None: eager)

    @property
    def plan(self) -> Any:
        """The partition's Plan while it is alive (plan.explain(): kernels, tuning, floors), else None."""
        return self.plan_ref() if self.plan_ref is not None else None


@dataclass
class GraphRecord:
    """One ATen graph handed to the backend (a forward, backward or inference graph)."""

    kind: str
    nodes: int
    partitions: list[PartitionRecord] = field(default_factory=list)
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)   # (op, reason) -> node count
    # inputs the graph mutates (inference graphs keep them: frontends/input_mutation.py): in place or copied back
    mutations: list[Mutation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what the frontend did to it (saved activations recomputed)
    direct: bool = False   # an inference graph called without AOTAutograd's runtime wrapper (direct_inference)


class CompiledPartition(torch.nn.Module):
    """A partition of the FX graph run as one fusegraph Plan; torch runs its FX code if that fails."""

    def __init__(self, sub: torch.fx.GraphModule, input_vals: Sequence[Any], record: PartitionRecord,
                 build_options: dict[str, Any], warn: Callable[[str], None],
                 static_args: frozenset[int] = frozenset(),
                 constant_args: dict[int, torch.Tensor] | None = None,
                 held: frozenset[int] | None = None, arg_strides: dict[int, tuple[int, ...]] | None = None,
                 gapped_saved: set[str] | None = None, record_saved: dict[str, tuple[int, ...]] | None = None,
                 own_layout_saved: set[str] | None = None) -> None:
        super().__init__()
        # saved activations crossing to the backward with gaps (views of a larger result, no copy),
        # padded rows or channels-last: the backward's inputs declared with those strides (arg_strides,
        # by position);
        # the forward's outputs that may be returned so (gapped_saved / own_layout_saved, by node name),
        # recorded in record_saved when they are
        self._arg_strides = arg_strides or {}
        self._gapped_saved = gapped_saved or set()
        self._own_layout_saved = own_layout_saved or set()
        self._record_saved = record_saved
        # storages of the graph outputs a caller may keep (None: all): the plan outputs sharing none
        # of them are never kept past the next call (build option held_outputs)
        self._held = held
        self._static_args = static_args     # partition inputs that are module parameters/buffers
        # partition inputs that are tensors the graph owns (get_attr, e.g. a lifted torch.tensor(...)
        # constant): IR constants, made on the plan's device at build time, not plan inputs
        self._constant_args = constant_args or {}
        self._to_device: list[int] = []     # CPU inputs of a partition on an accelerator: moved per call
        self.eager = sub
        self.record = record
        self._warn = warn
        self.plan: Any = None
        self._outputs: list[tuple[str, int]] = []
        self._plan_inputs: list[int] = []   # the partition inputs the Plan takes (not the meta placeholders)
        self._device: torch.device | None = None
        self._views: list[tuple[int, list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]] = []
        self._out_vals: list[Any] = []
        # settings.profile_ranges: the partition's calls show as one torch.profiler range
        self._range = f"fg:partition:{record.name}" if settings.profile_ranges else None
        self._fast: Callable[[Sequence[Any]], Any] | None = None   # the generated per-call glue (_compile_glue)
        try:
            self._build(input_vals, build_options)
            kernels: list[Any] = self.plan.kernels if self.plan is not None else []
            launched = [k for k in kernels if k.kind != "view"]   # views alias their input: no launch
            record.status, record.kernels = "fusegraph", len(launched)
            record.kernel_ops = [f"{k.kind}/{k.backend}: {'+'.join(k.ops)}" for k in launched]
            record.views = len(kernels) - len(launched)
            record.plan_ref = weakref.ref(self.plan) if self.plan is not None else None
            if self.plan is not None and self._range is None:
                self._fast = self._compile_glue()
        except Exception as err:  # any translation or build failure: this partition runs in torch
            if settings.debug >= 2:
                traceback.print_exc()
            self._fall_back(f"build failed: {type(err).__name__}: {err}")

    def _fall_back(self, reason: str) -> None:
        self._fast = None
        self.plan = None
        self.record.plan_ref = None
        self.record.status, self.record.reason = "eager", reason
        ops = ", ".join(sorted(self.record.ops))
        self._warn(f"fusegraph: partition {self.record.name} ({ops}) runs eagerly in torch: {reason}")

    def _build(self, input_vals: Sequence[Any], build_options: dict[str, Any]) -> None:
        g = Graph(name=self.record.name, compute_dtype="float32")
        env: dict[torch.fx.Node, Any] = {}
        placeholders = [n for n in self.eager.graph.nodes if n.op == "placeholder"]
        rng = {node for node in placeholders if is_rng_state(node)}
        # inputs an in-place scatter writes (a KV cache): the Plan writes the caller's tensor, so a
        # captured CUDA graph must read and write it in place (static), never a per-call copy
        mutated = mutated_placeholders(self.eager)
        written = {i for i, p in enumerate(placeholders) if p.name in mutated}
        devices = {v.device for i, (p, v) in enumerate(zip(placeholders, input_vals, strict=True))
                   if isinstance(v, torch.Tensor) and p not in rng and i not in self._constant_args}
        accelerators = {d for d in devices if d.type not in ("cpu", "meta")}
        if len(accelerators) == 1:   # CPU tensors next to device tensors (0-dim scalars, CPU index tensors
            # that torch accepts next to CUDA ones): moved to the device per call, not a failing input guard
            device = next(iter(accelerators))
            self._to_device = [i for i, (p, v) in enumerate(zip(placeholders, input_vals, strict=True))
                               if isinstance(v, torch.Tensor) and p not in rng and i not in self._constant_args
                               and v.device.type == "cpu"]
            input_vals = [v.to(device=device) if i in self._to_device else v for i, v in enumerate(input_vals)]
            devices = {d for d in devices if d.type != "cpu"} if self._to_device else devices
        for index, (node, val) in enumerate(zip(placeholders, input_vals, strict=True)):
            if node in rng:  # an attention philox seed/offset: only our attention backward takes it, and ignores it
                env[node] = None
                continue
            if index in written and (index in self._constant_args or index in self._to_device
                                     or not isinstance(val, torch.Tensor)):
                raise TypeError(f"partition input {node.name} is written in place but is not a tensor on the "
                                "partition's device")
            if index in self._constant_args:
                env[node] = g.constant(self._constant_args[index], name=node.name)
                continue
            if not isinstance(val, torch.Tensor):
                raise TypeError(f"partition input {node.name} is a {type(val).__name__}, not a tensor")
            self._plan_inputs.append(index)
            shape, strides = tuple(val.shape), self._arg_strides.get(index) or boundary_strides(val)
            dense = strides == contiguous_strides(shape)
            env[node] = g.tensor(shape, dtypes.canonical(val.dtype), name=node.name,
                                 layout=None if dense else "strided", strides=None if dense else strides,
                                 device=val.device.type,
                                 static=(index in self._static_args or index in written)
                                 and index not in self._to_device)
        out_args: Any = ()
        for node in self.eager.graph.nodes:
            if node.op == "get_attr":
                env[node] = g.constant(_attr(self.eager, str(node.target)))
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                with g.source_at(model_line(node)):
                    env[node] = translate_node(Ctx(g, node), args, kwargs)
            elif node.op == "output":
                out_args = node.args[0]
        self._single = not isinstance(out_args, list | tuple)
        out_nodes = [out_args] if self._single else list(out_args)
        inputs = [env[p].node.id if env[p] is not None else None for p in placeholders]
        # the in-place scatters' values -> the input each writes (its value IS that input after the write)
        inplace = {env[n].node.id: (env[n], inputs.index(env[n.args[0]].node.id)) for n in self.eager.graph.nodes
                   if n.op == "call_function" and isinstance(env.get(n), Tensor) and env[n].node.op in INPLACE_IR_OPS}
        plan_outputs: list[Tensor] = []
        out_strides: list[tuple[int, ...] | None] = []
        kept: set[int] = set()   # plan outputs a caller may keep
        gapped_at: dict[int, tuple[str, tuple[int, ...]]] = {}   # plan output -> (name, traced strides)
        own_layout_at: dict[int, tuple[str, int]] = {}   # plan output -> (name, index in _out_vals)
        self._device = devices.pop() if len(devices) == 1 else None
        for out in out_nodes:
            value = env[out] if isinstance(out, torch.fx.Node) else None
            self._out_vals.append(out.meta.get("val") if isinstance(out, torch.fx.Node) else None)
            if isinstance(out, torch.fx.Node) and is_rng_state(out):  # a philox seed/offset of our attention
                self._outputs.append(("empty", len(self._out_vals) - 1))
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"partition output {out} is not a tensor of the graph")
            if value.node.id in inputs:
                self._outputs.append(("input", inputs.index(value.node.id)))
                continue
            if value.node.id in inplace:   # the written input itself (updated by the Plan's run)
                self._outputs.append(("input", inplace[value.node.id][1]))
                continue
            chain = _view_chain(out, placeholders)
            # e.g. a transposed weight saved for the backward: a view, not a copy
            if chain is not None and chain[0] not in self._constant_args:
                self._outputs.append(("view", len(self._views)))
                self._views.append(chain)
                continue
            if all(value is not t for t in plan_outputs):
                plan_outputs.append(value)
                val = out.meta.get("val")   # returned in torch's layout (no restriding copy after)
                if out.name in self._gapped_saved and isinstance(val, torch.Tensor):
                    gapped_at[len(plan_outputs) - 1] = (out.name, tuple(val.stride()))
                    out_strides.append(tuple(val.stride()))   # with its gaps, if the plan can make it a view
                elif out.name in self._own_layout_saved and isinstance(val, torch.Tensor):
                    # the plan's own layout (pad_outputs: padded rows; layout_outputs: 4-D, channels-last kept)
                    own_layout_at[len(plan_outputs) - 1] = (out.name, len(self._out_vals) - 1)
                    out_strides.append(None)
                else:
                    out_strides.append(boundary_strides(val) if isinstance(val, torch.Tensor) else None)
            position = next(i for i, t in enumerate(plan_outputs) if t is value)
            key = storage_key(out.meta.get("val"))
            if self._held is None or key is None or key in self._held:
                kept.add(position)
            self._outputs.append(("plan", position))
        live = _ancestors([t.node for t in plan_outputs])
        for value, _ in inplace.values():   # a write nothing in the Plan reads: an extra output keeps it
            if value.node.id not in live:
                kept.add(len(plan_outputs))
                plan_outputs.append(value)
                out_strides.append(tuple(value.spec.memory_strides))
        if plan_outputs:
            g.set_output(*plan_outputs)
            held = {} if self._held is None else {"held_outputs": sorted(kept)}
            own: dict[str, list[int]] = {}
            if own_layout_at and settings.pad_saved:
                own["pad_outputs"] = sorted(own_layout_at)
            four_d = sorted(k for k in own_layout_at if plan_outputs[k].spec.rank == 4)
            if four_d and settings.nhwc_saved:
                own["layout_outputs"] = four_d
            self.plan = g.build(device=None if self._device is None else self._device.type,
                                **{"output_strides": out_strides, **held, **own, **build_options})
            if self._record_saved is not None:   # the saved activations the plan returns as views, with gaps
                for k, (name, traced) in gapped_at.items():
                    spec = self.plan.graph.outputs[k].spec
                    if same_strides(tuple(spec.shape), tuple(spec.memory_strides), traced):
                        self._record_saved[name] = traced
                for k, (name, at) in own_layout_at.items():   # in the plan's layout: not restrided to the traced one
                    spec = self.plan.graph.outputs[k].spec
                    if not same_strides(tuple(spec.shape), tuple(spec.memory_strides),
                                         tuple(self._out_vals[at].stride())):
                        self._record_saved[name] = tuple(spec.memory_strides)
                        self._out_vals[at] = None

    def forward(self, *args: Any) -> Any:
        fast = self._fast
        if fast is not None:
            return fast(args)
        if self.record.status != "fusegraph":
            return self.eager(*args)
        if self._range is not None:
            with torch.profiler.record_function(self._range):
                return self._run(args)
        return self._run(args)

    def _run(self, args: Sequence[Any]) -> Any:
        try:
            plan_args = [args[i].to(device=self._device, non_blocking=True) if i in self._to_device else args[i]
                         for i in self._plan_inputs]
            results = self.plan.run(plan_args) if self.plan is not None else []
        except Exception as err:  # a kernel that fails at its first launch (e.g. Triton compile error)
            return self._run_failed(err, args)
        if self._range is not None:   # settings.profile_ranges: the glue's steps named apart
            with torch.profiler.record_function("fg:glue:views and placeholders"):
                outs = self._outs(args, results)
            with torch.profiler.record_function("fg:glue:boundary strides"):
                outs = [_with_strides(o, v) for o, v in zip(outs, self._out_vals, strict=True)]
        else:
            outs = [_with_strides(o, v) for o, v in zip(self._outs(args, results), self._out_vals, strict=True)]
        return outs[0] if self._single else tuple(outs)

    def _compile_glue(self) -> Callable[[Sequence[Any]], Any]:
        """`_run` as one generated function for this partition: the plan's inputs picked by position,
        each output taken from where it comes (a plan result, an input, a view replayed on an input,
        a placeholder) with no per-call dispatch over kinds, and restrided only when its strides
        differ from the traced ones (`_with_strides`, the same rule)."""
        env: dict[str, Any] = {"RUN": self.plan.run, "FAILED": self._run_failed, "DEV": self._device,
                               "WS": _with_strides, "REPLAY": _replay, "PH": self._placeholder}
        picks = ", ".join(f"args[{i}].to(device=DEV, non_blocking=True)" if i in self._to_device else f"args[{i}]"
                          for i in self._plan_inputs)
        lines = ["def run(args):", "    try:", f"        r = RUN([{picks}])", "    except Exception as err:",
                 "        return FAILED(err, args)"]
        names = []
        for k, ((kind, i), val) in enumerate(zip(self._outputs, self._out_vals, strict=True)):
            if kind == "input":
                expr = f"args[{i}]"
            elif kind == "plan":
                expr = f"r[{i}]"
            elif kind == "view":
                env[f"VIEW{k}"] = self._views[i]
                expr = f"REPLAY(VIEW{k}, args)"
            else:
                env[f"VAL{k}"] = self._out_vals[i]
                expr = f"PH(VAL{k}, args)"
            lines.append(f"    o{k} = {expr}")
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                env[f"T{k}"], env[f"V{k}"] = tuple(val.stride()), val
                lines += [f"    if o{k}.stride() != T{k}:", f"        o{k} = WS(o{k}, V{k})"]
            names.append(f"o{k}")
        if self._single:
            lines.append(f"    return {names[0]}")
        else:
            lines.append(f"    return ({', '.join(names)},)" if names else "    return ()")
        exec(compile("\n".join(lines), f"<partition {self.record.name} glue>", "exec"), env)
        return env["run"]  # type: ignore[no-any-return]

    def _run_failed(self, err: Exception, args: Sequence[Any]) -> Any:
        """A plan call that raised (a kernel failing at its first launch): this partition runs in torch."""
        self._fall_back(f"run failed: {type(err).__name__}: {err}")
        return self.eager(*args)

    def _outs(self, args: Sequence[Any], results: Sequence[Any]) -> list[Any]:
        return [args[i] if kind == "input" else results[i] if kind == "plan" else _replay(self._views[i], args)
                if kind == "view" else self._placeholder(self._out_vals[i], args) for kind, i in self._outputs]

    def _placeholder(self, val: torch.Tensor, args: Sequence[Any]) -> torch.Tensor:
        """Zeros for an attention philox seed/offset (no dropout: nothing reads them), on the traced
        device (torch keeps them on the CPU) or, traced on the meta device, the partition's."""
        device = val.device if val.device.type != "meta" else self._device or "cpu"
        try:
            return torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)
        except RuntimeError:  # no fill kernel for this dtype on this device (uint64): unread anyway
            return torch.empty(tuple(val.shape), dtype=val.dtype, device=device)


def _ancestors(nodes: Sequence[Any]) -> set[int]:
    """Ids of the IR nodes `nodes` are computed from (themselves included)."""
    seen: set[int] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node.id not in seen:
            seen.add(node.id)
            todo.extend(node.inputs)
    return seen


# View ops replayed by torch on a partition input when their result is a partition output.
REPLAYABLE_VIEWS = VIEW_OPS - {aten.clone.default, operator.getitem}


def _view_chain(node: torch.fx.Node, placeholders: Sequence[torch.fx.Node]
                ) -> tuple[int, list[tuple[Any, tuple[Any, ...], dict[str, Any]]]] | None:
    """(input index, [(view op, other args, kwargs), ...]) when `node` is views of a partition input."""
    chain = []
    while node.op == "call_function" and node.target in REPLAYABLE_VIEWS and isinstance(node.args[0], torch.fx.Node):
        if any(isinstance(a, torch.fx.Node) for a in node.args[1:]) or node.kwargs:
            return None
        chain.append((node.target, tuple(node.args[1:]), dict(node.kwargs)))
        node = node.args[0]
    if node.op != "placeholder" or not chain:
        return None
    return placeholders.index(node), chain[::-1]


# A view replayed on a real input whose strides differ from the traced (fake) ones, e.g. the output
# of an eager op whose real layout is not what its meta function said: reshape is a view when the
# strides allow one and a copy otherwise, where aten.view would raise.
_REPLAY_AS = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def _replay(view: tuple[int, list[tuple[Any, tuple[Any, ...], dict[str, Any]]]], args: Sequence[Any]) -> Any:
    index, chain = view
    value = args[index]
    for op, rest, kwargs in chain:
        value = _REPLAY_AS.get(op, op)(value, *rest, **kwargs)
    return value


def _with_strides(out: torch.Tensor, val: Any) -> torch.Tensor:
    """The output in the strides torch would have produced (what AOTAutograd's decisions assume:
    a reshape traced as a view, an SDPA backend whose output follows the query's stride order).
    A traced value with gaps (e.g. q sliced out of a fused qkv projection) gets a dense tensor with
    the same stride order; an overlapping one (an expand) is returned as it is."""
    if not isinstance(val, torch.Tensor) or out.stride() == val.stride() or out.dim() == 0:
        return out
    if dense_strides_in_order(val) is None:
        return out  # an overlapping traced layout (an expand): as it is
    strides = boundary_strides(val)
    if strides == out.stride():
        return out
    restrided = torch.empty_strided(tuple(val.shape), strides, dtype=out.dtype, device=out.device)
    return restrided.copy_(out)


def boundary_strides(val: torch.Tensor) -> tuple[int, ...]:
    """The strides a tensor crossing a partition boundary has at run time when our partitions made
    it: the traced ones, except that a traced value with gaps comes dense in the same order
    (_with_strides). Partition inputs are built for these, so a value saved by our forward and read
    by our backward needs no rebuild of the backward's Plan."""
    if is_non_overlapping_and_dense(val):
        return tuple(val.stride())
    ordered = dense_strides_in_order(val)
    return tuple(val.stride()) if ordered is None else ordered


def dense_strides_in_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dense strides with `t`'s dimension order (innermost = smallest stride), or None when `t`
    has overlapping elements (a stride-0 or otherwise aliased layout)."""
    return dense_in_order(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()))


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Every element has its own memory location and no gaps (a permutation of a contiguous layout)."""
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _attr(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def partition_graph(gm: torch.fx.GraphModule, kind: str, build_options: dict[str, Any],
                    warn: Callable[[str], None], static_inputs: Sequence[int] = (),
                    held_outputs: Sequence[int] | None = None, saved_strides: dict[str, tuple[int, ...]] | None = None
                    ) -> tuple[torch.fx.GraphModule, GraphRecord]:
    """The FX graph with each supported region replaced by a CompiledPartition module. `static_inputs`:
    positions of gm's placeholders that are parameters or buffers (the same tensors at every call);
    a partition reading one directly declares it a static input (read in place by a CUDA graph).
    `held_outputs`: positions of gm's outputs the caller may keep past its next call (None: all); a
    partition output sharing storage with none of them is never kept (build option held_outputs).
    `saved_strides` (training): a forward records in it, by node name, the saved activations its plans
    return with gaps, as views of a larger result (q, k, v of a fused qkv projection), instead of
    copying them dense; the backward, whose inputs carry the same names, declares those inputs so."""
    held = held_storages(gm, held_outputs)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    static_names = {placeholders[i] for i in static_inputs if 0 <= i < len(placeholders)}
    mutations = reinplace_input_mutations(gm) if kind == "inference" else []
    record = GraphRecord(kind, sum(1 for n in gm.graph.nodes
                                   if n.op == "call_function" and n.target is not operator.getitem),
                         mutations=mutations)
    support = _Support()
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    partitions = [p for p in partitioner.propose_partitions()
                  if any(n.target not in VIEW_OPS for n in p.nodes)]
    saved_only = _saved_only(gm, partitions, held_outputs) if kind == "forward" and saved_strides is not None \
        else {}
    gapped_saved = {name for name, val in saved_only.items()
                    if not is_non_overlapping_and_dense(val) and dense_strides_in_order(val) is not None} \
        if settings.saved_views else set()
    # saved activations returned in the plan's own layout: padded rows (pad_saved), channels-last (nhwc_saved)
    own_layout_saved = {name for name, val in saved_only.items() if val.is_contiguous() and val.dim() >= 2
                    and (settings.pad_saved or (settings.nhwc_saved and val.dim() == 4))}
    for node, reason in support.reasons.items():   # write-backs: not an op of the model (record.mutations)
        if node.target is not operator.getitem and write_back_input(node) is None:
            record.fallbacks[(op_name(node), reason)] += 1
    if not partitions:
        return gm, record
    split = partitioner.fuse_partitions(partitions)   # submodules fused_0, fused_1, ... (every torch version)
    for node in list(split.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("fused_"):
            continue
        sub = getattr(split, str(node.target))
        ops = Counter(op_name(n) for n in sub.graph.nodes
                      if n.op == "call_function" and n.target is not operator.getitem)
        part = PartitionRecord(f"{kind}_{node.target}", ops)
        input_vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        static_args = frozenset(i for i, a in enumerate(node.args)
                                if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in static_names)
        constant_args = {i: _attr(split, str(a.target)) for i, a in enumerate(node.args)
                         if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                         and isinstance(_attr(split, str(a.target)), torch.Tensor)}
        arg_strides = {i: saved_strides[a.name] for i, a in enumerate(node.args)
                       if kind == "backward" and saved_strides and isinstance(a, torch.fx.Node)
                       and a.op == "placeholder" and a.name in saved_strides}
        compiled = CompiledPartition(sub, input_vals, part, build_options, warn, static_args, constant_args, held,
                                     arg_strides, gapped_saved, saved_strides if kind == "forward" else None,
                                     own_layout_saved)
        setattr(split, str(node.target), compiled)
        record.partitions.append(part)
    split.recompile()
    order_write_backs(split)   # copy_(input, new) after every partition that reads the old value
    return split, record


class _Direct:
    """`self` of a GraphModule's code run as a plain function (`direct_call`): the attributes set on it
    (its partitions' forwards), everything else looked up on the GraphModule."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self._gm = gm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gm, name)


def direct_call(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """gm's forward as a plain function, what the backend hands AOTAutograd: the FX code of gm run with
    its CompiledPartition children called through their `forward`, so that a call pays no
    nn.Module.__call__ (4-7 us per call of a small MLP on this machine's CPU, bench/host_call_cpu.py;
    a decode step's whole call is ~140 us of host time on the H200's). Other children (and
    constants) are gm's own."""
    code = gm.graph.python_code(root_module="self")
    env = dict(code.globals)
    exec(compile(code.src, f"<{type(gm).__name__} direct forward>", "exec"), env)
    forward = env["forward"]
    this = _Direct(gm)
    for name, child in gm.named_children():
        if isinstance(child, CompiledPartition):
            setattr(this, name, functools.partial(_partition_forward, child))

    def run(*args: Any) -> Any:
        return forward(this, *args)

    run.graph_module = gm  # type: ignore[attr-defined]
    return run


def _partition_forward(part: CompiledPartition, *args: Any) -> Any:
    return part.forward(*args)   # looked up per call: a patched forward (bench/decode_host_gpu.py) is seen


def _output_values(gm: torch.fx.GraphModule) -> list[Any] | None:
    """What gm returns, one entry per output (None: gm has no output node)."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return None
    return list(out.args[0]) if isinstance(out.args[0], list | tuple) else [out.args[0]]


def _saved_only(gm: torch.fx.GraphModule, partitions: Sequence[Any],
                held_outputs: Sequence[int] | None) -> dict[str, torch.Tensor]:
    """A forward's saved activations (outputs past `held_outputs`) computed inside a partition and read
    by nothing outside it, by name, with their traced values: its plan may choose their layout (a
    view with gaps instead of a copy, padded rows, channels-last), which the backward then declares."""
    values = _output_values(gm)
    if values is None or held_outputs is None:
        return {}
    kept = set(held_outputs)
    members = {n: p for p in partitions for n in p.nodes}
    found: dict[str, torch.Tensor] = {}
    for i, node in enumerate(values):
        if i in kept or not isinstance(node, torch.fx.Node) or node not in members:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and \
                all(u.op == "output" or members.get(u) is members[node] for u in node.users):
            found[node.name] = val
    return found


_TRACE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def model_line(node: torch.fx.Node) -> str | None:
    """The model's own code line an FX node was traced from ("file:line", the innermost frame of its
    recorded stack trace), None when it has none."""
    trace = node.meta.get("stack_trace")
    if not isinstance(trace, str):
        return None
    found = _TRACE_LINE.findall(trace)
    if not found:
        return None
    path, line = found[-1]
    return f"{os.path.relpath(path) if path.startswith(os.getcwd()) else path}:{line}"


def storage_key(val: Any) -> int | None:
    """An id of the storage behind a traced value (views share it), None when it has none."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return int(val.untyped_storage()._cdata)
    except Exception:  # a tensor without a storage (some subclasses): unknown
        return None


def held_storages(gm: torch.fx.GraphModule, held_outputs: Sequence[int] | None) -> frozenset[int] | None:
    """The storages of gm's outputs at `held_outputs` (None: all outputs, or one of them unknown)."""
    values = _output_values(gm)
    if held_outputs is None or values is None:
        return None
    keys: set[int] = set()
    for i in held_outputs:
        node = values[i] if 0 <= i < len(values) else None
        if not isinstance(node, torch.fx.Node):
            continue
        key = storage_key(node.meta.get("val"))
        if key is None:
            if isinstance(node.meta.get("val"), torch.Tensor) or "val" not in node.meta:
                return None   # a tensor output whose storage is unknown: every output may be kept
            continue          # a symbolic int or None: no storage to keep
        keys.add(key)
    return frozenset(keys)


def warn_fallback(message: str) -> None:
    warnings.warn(message, FallbackWarning, stacklevel=3)
