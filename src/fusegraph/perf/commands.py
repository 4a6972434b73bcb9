"""CLI: `fusegraph bench`, `explain`, `calibrate`, `whatif` (thin over fusegraph.perf)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import FusegraphError
from .devices import RATE_KEYS, DeviceSpec, custom_spec, get_device, known_names

_TARGET_HELP = ("a Python script (path.py) or module (pkg.mod, pkg.mod:func) defining build() -> (plan, inputs): "
                "plan = g.build(), inputs = its input tensors (list in declaration order, feed dict, or None)")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="measure the present GPU's ceilings (copy bandwidth, GEMM rates, "
                              "launch latency) and cache them for every report")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser("explain", help="per-kernel report: time, bytes, FLOPs, %% of floor, bound, fused ops",
                              description="Explain a compiled plan kernel by kernel. " + _TARGET_HELP)
    p.add_argument("target", help=_TARGET_HELP)
    _add_spec_args(p)
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (roofline, table, timeline)")
    p.add_argument("--png", metavar="FILE", help="write the roofline plot as a PNG")
    p.add_argument("--no-measure", action="store_true", help="do not time kernels even on a GPU")
    p.set_defaults(func=cmd_explain)

    p = subparsers.add_parser("whatif", help="project a plan (or the bench suite) onto another device; sensitivity",
                              description="Project kernel times onto a device with the roofline model. Without "
                              "a target, projects the bench suite's workloads. " + _TARGET_HELP)
    p.add_argument("target", nargs="?", help=_TARGET_HELP)
    _add_spec_args(p)
    p.add_argument("--suite", default="memory,compute", help="workloads when no target is given")
    p.add_argument("--shapes", default="full", choices=("small", "full"))
    p.add_argument("--host-launch", action="store_true",
                   help="charge the Python launch cost per kernel instead of the CUDA-graph gap")
    p.add_argument("--validate", action="store_true",
                   help="(GPU) compare predicted vs measured per kernel on the present GPU")
    p.add_argument("--list-devices", action="store_true", help="print every known device spec and its sources")
    p.set_defaults(func=cmd_whatif)

    p = subparsers.add_parser("bench", help="run the BENCHMARKS.md suite side by side (correctness first)")
    p.add_argument("--suite", default="memory", help="memory, compute, all, or a comma-separated list "
                   "(suites or workload names)")
    p.add_argument("--compare", default="eager,inductor,inductor-max",
                   help="comma-separated: eager, inductor, inductor-max, jax, cudnn (fusegraph always runs)")
    p.add_argument("--shapes", default=None, choices=("small", "full"),
                   help="full (BENCHMARKS.md sizes; GPU) or small (CPU correctness); default full on a GPU")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and markdown results")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help=f"device model: {', '.join(known_names())} (default: the present GPU, else "
                   "H200); with the flags below, they override its values")
    p.add_argument("--bandwidth", help="memory bandwidth, e.g. 8TB/s")
    for key in RATE_KEYS:
        p.add_argument(f"--{key}", help=f"{key} peak rate, e.g. 2.2PF")
    p.add_argument("--l2", help="L2 size, e.g. 50MB")
    p.add_argument("--sms", help="SM count")
    p.add_argument("--launch-us", help="per-kernel launch gap in a CUDA graph, microseconds")
    p.add_argument("--datasheet", action="store_true", help="ignore measured ceilings (fusegraph calibrate)")


def spec_from_args(args: argparse.Namespace, default: str | None = None) -> DeviceSpec | None:
    """The device spec the flags describe: --device, custom numbers, or both; None = the default."""
    from .calibrate import effective_spec

    fields = {k: getattr(args, k, None) for k in (*RATE_KEYS, "bandwidth", "l2", "sms")}
    fields["launch_us"] = getattr(args, "launch_us", None)
    given = {k: v for k, v in fields.items() if v is not None}
    use_cal = not getattr(args, "datasheet", False)
    name = getattr(args, "device", None) or default
    if given:
        base = effective_spec(get_device(name), use_cal) if name else None
        return custom_spec("custom" if base is None else base.name + " (custom)", base=base, **given)
    if name:
        return effective_spec(get_device(name), use_cal)
    return None if use_cal else effective_spec(None, use_calibration=False)


def _fail(err: Exception) -> int:
    from .loader import TargetError

    if isinstance(err, TargetError) and err.user_traceback:
        sys.stderr.write(err.user_traceback)
    print(f"error: {err}", file=sys.stderr)
    return 1 if isinstance(err, TargetError) else 2


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate

    try:
        calibrate()
    except FusegraphError as err:
        return _fail(err)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import analyze_plan
    from .loader import load_target

    try:
        spec = spec_from_args(args)
        plan, inputs, title = load_target(args.target)
        report = analyze_plan(plan, spec, measure=not args.no_measure, inputs=inputs, title=title)
        print(report.to_text())
        if args.png or args.html:
            from .report import write_html, write_png

            if args.png:
                print(f"roofline written to {write_png(report, args.png)}")
            if args.html:
                print(f"HTML report written to {write_html(report, args.html)}")
    except FusegraphError as err:
        return _fail(err)
    return 0


def _suite_plans(suite: str, shapes: str, device: str) -> list[tuple[str, Any, Any]]:
    """(name, plan, inputs-or-None) for each buildable workload of the suite."""
    from .workloads import select

    out = []
    for w in select(suite):
        reason = w.missing()
        if reason:
            print(f"skipped {w.name}: {reason}", file=sys.stderr)
            continue
        dims = w.shapes[shapes]
        try:
            plan = w.graph(dims).build(device=device)
        except Exception as err:  # one workload the compiler cannot build yet does not stop the rest
            print(f"skipped {w.name}: build failed: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        out.append((w.name, plan, w.make_inputs(dims, device) if device == "cuda" else None))
    return out


def cmd_whatif(args: argparse.Namespace) -> int:
    import torch

    from .calibrate import effective_spec
    from .loader import load_target
    from .whatif import validate_plan, validation_text, whatif_text

    if args.list_devices:
        print(list_devices_text())
        return 0
    try:
        if args.validate:
            if not torch.cuda.is_available():
                print("error: whatif --validate measures kernels and needs a GPU; none is present", file=sys.stderr)
                return 2
            spec = spec_from_args(args) or effective_spec()
            targets = [(*load_target(args.target)[:2], args.target)] if args.target else \
                [(p, i, n) for n, p, i in _suite_plans(args.suite, args.shapes, "cuda")]
            rows = []
            for plan, inputs, name in targets:
                try:
                    rows += validate_plan(plan, spec, inputs, workload=str(name))
                except Exception as err:
                    print(f"skipped {name}: measuring failed: {type(err).__name__}: {err}", file=sys.stderr)
            print(validation_text(rows, spec))
            return 0
        target_spec = spec_from_args(args)
        if target_spec is None:
            print("error: whatif needs a device: --device NAME or a custom spec (--bandwidth 8TB/s --bf16 2.2PF); "
                  f"known devices: {', '.join(known_names())}", file=sys.stderr)
            return 2
        reference = effective_spec(None, use_calibration=not args.datasheet)
        if args.target:
            plan, _, title = load_target(args.target)
            print(whatif_text(plan.kernels, target_spec, reference, title=title, host_launch=args.host_launch))
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            for name, plan, _ in _suite_plans(args.suite, args.shapes, device):
                print(whatif_text(plan.kernels, target_spec, reference, title=f"{name} ({args.shapes})",
                                  host_launch=args.host_launch))
                print()
    except FusegraphError as err:
        return _fail(err)
    return 0


def list_devices_text() -> str:
    from .calibrate import effective_spec
    from .devices import DEVICES, fmt_rate

    lines = []
    for name in DEVICES:
        spec = effective_spec(name)
        sparse = ", ".join(f"{k} {fmt_rate(v)}" for k, v in spec.sparse.items())
        lines += [spec.summary(), f"    2:4 sparse: {sparse or 'none'}", f"    source: {spec.source}"]
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import run_bench

    gpu = torch.cuda.is_available()
    shapes = args.shapes or ("full" if gpu else "small")
    compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    try:
        record = run_bench(args.suite, compare, shapes, args.out, show_progress=not args.no_progress)
    except FusegraphError as err:
        return _fail(err)
    from .bench import markdown_table

    print(markdown_table(record))
    if not record["timed"]:
        print("\ncorrectness stage only: timings need a GPU (no CUDA device is present)")
    print(f"\nwritten: {', '.join(record['files'])}")
    failed = [r["name"] for r in record["results"] if r["status"] == "failed"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
