"""Every cuDNN execution plan for an SDPA graph, timed: which engine and knob setting is fastest for
GPT-2's attention (B8 H12 S1024 D64, causal, bf16) and issue #4's (B4 H16 S4096 D128), forward with
its softmax statistics and backward fed them (backends/cudnn_plans.SdpaRecipe, the graphs fusegraph
builds). For each graph: the plans heuristics modes A, B and FALLBACK offer (name, engine, knobs,
workspace, device time), then, for each engine among them, every setting of its knobs cuDNN reports
(get_knobs_for_engine, at most --max-knob-plans a graph) appended with create_execution_plan. Each
plan's results are compared with plan 0's (relative norm error) so a fast but wrong plan shows.

    PYTHONPATH=src python bench/cudnn_sdpa_engines_gpu.py [--shape 8 12 1024 64 --layout gpt2] [--max-knob-plans 48]

Text to stdout and $OUT/cudnn_sdpa_engines.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import sys
from contextlib import redirect_stdout
from typing import Any

import torch


def layouts(b: int, h: int, s: int, d: int, layout: str) -> dict[str, Any]:
    """(shape, strides) per role: "dense" BHSD everywhere; "gpt2": q, k, v views of one packed
    [B, S, 3, H, D] projection, o, dO and the gradients [B, S, H, D] in memory."""
    from fusegraph.ir.spec import strides_for_order

    shape = (b, h, s, d)
    dense = (shape, tuple(strides_for_order(shape, (0, 1, 2, 3))))
    if layout == "dense":
        return {"q": dense, "k": dense, "v": dense, "o": dense}
    packed = (shape, (s * 3 * h * d, d, 3 * h * d, 1))
    bshd = (shape, (s * h * d, d, h * d, 1))
    return {"q": packed, "k": packed, "v": packed, "o": bshd}


def knob_values(knob: Any) -> tuple[Any, list[int]]:
    """(knob type, its values) of a frontend Knob, whatever its attribute names in this build."""
    def first(*names: str) -> Any:
        for n in names:
            if hasattr(knob, n):
                return getattr(knob, n)
        raise AttributeError(f"knob {knob!r} has none of {names}")
    kind = first("type", "knob_type")
    lo, hi = int(first("minValue", "min_value", "min")), int(first("maxValue", "max_value", "max"))
    step = max(1, int(first("stride", "step")))
    return kind, list(range(lo, hi + 1, step))


def run(args: argparse.Namespace) -> None:
    from fusegraph.backends import cudnn_frontend as fe
    from fusegraph.backends import cudnn_plans as plans
    from fusegraph.perf.timing import device_time

    cudnn, why = fe._load()
    if cudnn is None or not torch.cuda.is_available():
        print(f"needs a GPU and nvidia-cudnn-frontend: {why or 'no GPU'}")
        return
    b, h, s, d = args.shape
    lay = layouts(b, h, s, d, args.layout)
    stats = ((b, h, s, 1), (h * s, s, 1, 1))
    scale = d ** -0.5
    fwd = plans.SdpaRecipe(False, lay["q"], lay["k"], lay["v"], lay["o"], stats, None, None, "bfloat16", scale, True)
    bwd = plans.SdpaRecipe(True, lay["q"], lay["k"], lay["v"], lay["o"], stats, lay["o"], (lay["o"],) * 3,
                           "bfloat16", scale, True)
    device = torch.device("cuda", torch.cuda.current_device())
    handle = fe._handle(cudnn, device)
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(layout: Any, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        shape, strides = layout
        size = max(sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1, 1)
        base = torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return base.as_strided(shape, strides)

    q, k, v, d_o = (tensor(lay[r]) for r in ("q", "k", "v", "o"))
    causal_flops = 4 * b * h * s * s * d / 2

    for recipe in (fwd, bwd):
        label = recipe.describe()
        flops = causal_flops * (2.5 if recipe.backward else 1.0)
        if recipe.backward:
            st = torch.empty(*stats[0], device=device, dtype=torch.float32)
            o = torch.empty_strided(*lay["o"], device=device, dtype=torch.bfloat16)
            fgraph, ft = plans.graph_from_recipe(cudnn, handle, fwd)
            fe._build(fgraph, cudnn)
            ws = torch.empty(max(int(fgraph.get_workspace_size()), 1), device=device, dtype=torch.uint8)
            fgraph.execute({ft["q"]: q, ft["k"]: k, ft["v"]: v, ft["o"]: o, ft["stats"]: st}, ws, handle=handle)
            grads = [torch.empty_strided(*lay["o"], device=device, dtype=torch.bfloat16) for _ in range(3)]
            binds = {"q": q, "k": k, "v": v, "o": o, "dO": d_o, "stats": st, "dq": grads[0], "dk": grads[1],
                     "dv": grads[2]}
            results = grads
        else:
            o = torch.empty_strided(*lay["o"], device=device, dtype=torch.bfloat16)
            st = torch.empty(*stats[0], device=device, dtype=torch.float32)
            binds = {"q": q, "k": k, "v": v, "o": o, "stats": st}
            results = [o, st]
        print(f"== {label}, B{b} H{h} S{s} D{d} causal bf16, layout {args.layout}; "
              f"{flops / 1e9:.1f} GFLOP (causal half)")
        rows: list[tuple[float, str]] = []
        reference: list[torch.Tensor] | None = None

        def time_plan(graph: Any, tensors: dict[str, Any], index: int, tag: str) -> None:
            nonlocal reference
            try:
                graph.build_plan_at_index(index)
                wsize = int(graph.get_workspace_size_plan_at_index(index))
            except Exception as err:
                print(f"   {tag}: does not build: {type(err).__name__}: {str(err)[:140]}")
                return
            ws = torch.empty(max(wsize, 1), device=device, dtype=torch.uint8)
            bindings = {tensors[r]: t for r, t in binds.items()}

            def call() -> None:
                graph.execute_plan_at_index(bindings, ws, index=index, handle=handle)
            try:
                for r in results:
                    r.fill_(float("nan"))
                cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
                call()
                torch.cuda.synchronize()
                got = [r.float().clone() for r in results]
                if reference is None:
                    reference = got
                err = max(float((x - y).norm() / max(float(y.norm()), 1e-30)) for x, y in
                          zip(got, reference, strict=True))
                t = device_time(call, calls=20, repeats=5, graph=False).ms
            except Exception as err:
                print(f"   {tag}: does not run: {type(err).__name__}: {str(err)[:140]}")
                return
            line = (f"   {tag}: {t:.4f} ms  {flops / t / 1e9:.0f} TFLOP/s  workspace {wsize / 2**20:.1f} MiB  "
                    f"err vs first {err:.1e}")
            print(line, flush=True)
            rows.append((t if err < 2e-2 else float("inf"), tag))

        engines: dict[int, str] = {}
        for modes in (("A",), ("B",), ("FALLBACK",)):
            graph, tensors = plans.graph_from_recipe(cudnn, handle, recipe)
            try:
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
                count = int(graph.get_execution_plan_count())
            except Exception as err:
                print(f" heuristics {'+'.join(modes)}: no plans: {type(err).__name__}: {str(err)[:160]}")
                continue
            print(f" heuristics {'+'.join(modes)}: {count} plans")
            for i in range(count):
                try:
                    name = graph.get_plan_name_at_index(i)
                    engine, knobs = graph.get_engine_and_knobs_at_index(i)
                    engines.setdefault(int(engine), name)
                    tag = f"{'+'.join(modes)}[{i}] {name} engine {engine} knobs {knobs}"
                except Exception as err:
                    tag = f"{'+'.join(modes)}[{i}] ({type(err).__name__}: {str(err)[:80]})"
                time_plan(graph, tensors, i, tag)
        for engine, name in engines.items():
            graph, tensors = plans.graph_from_recipe(cudnn, handle, recipe)
            try:
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A])   # lowers the graph to the backend's
                space = [knob_values(kn) for kn in graph.get_knobs_for_engine(engine)]
            except Exception as err:
                print(f" engine {engine} ({name}): knobs not listed: {type(err).__name__}: {str(err)[:160]}")
                continue
            print(f" engine {engine} ({name}): knobs " + ", ".join(f"{kind}: {vals[0]}..{vals[-1]} ({len(vals)})"
                                                                  for kind, vals in space))
            combos = list(itertools.product(*[vals for _, vals in space]))[: args.max_knob_plans]
            for combo in combos:
                knobs = {kind: val for (kind, _), val in zip(space, combo, strict=True)}
                g, t = plans.graph_from_recipe(cudnn, handle, recipe)
                try:
                    g.validate()
                    g.build_operation_graph()
                    g.create_execution_plan(engine, knobs)
                    index = int(g.get_execution_plan_count()) - 1
                except Exception as err:
                    print(f"   engine {engine} knobs {combo}: not created: {type(err).__name__}: {str(err)[:100]}")
                    continue
                time_plan(g, t, index, f"engine {engine} knobs {combo}")
        if rows:
            best = min(rows)
            print(f" fastest (within 2e-2 of plan 0): {best[0]:.4f} ms {flops / best[0] / 1e9:.0f} TFLOP/s: {best[1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=(8, 12, 1024, 64), metavar=("B", "H", "S", "D"))
    parser.add_argument("--layout", choices=("dense", "gpt2"), default="gpt2")
    parser.add_argument("--max-knob-plans", type=int, default=48)
    args = parser.parse_args()
    text = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            sys.__stdout__.write(s)
            text.write(s)
            return len(s)

        def flush(self) -> None:
            sys.__stdout__.flush()

    print(f"# {' '.join(sys.argv)}; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, "
          f"torch {torch.__version__}")
    with redirect_stdout(Tee()):
        run(args)
    if os.environ.get("OUT"):
        name = "cudnn_sdpa_engines_" + "x".join(map(str, args.shape)) + ".txt"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
