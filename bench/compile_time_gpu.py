"""Compile time of the demo transformer block: fusegraph cold and warm against torch.compile cold and warm.

    python bench/compile_time_gpu.py            # on the GPU machine; JSON to $OUT/compile_time.json
    python bench/compile_time_gpu.py --size small --dtype float16   # a quick check
    python bench/compile_time_gpu.py --profile  # + where each fusegraph build's time goes (stages,
        # kernels, tuning, Triton compiles; FUSEGRAPH_PROFILE_BUILD=1) and a cProfile of each build:
        # top 30 by cumulative time printed, full stats in $OUT/compile_profile_{cold,warm}.prof

Each measurement runs in a fresh Python process (what a user pays on a new run):
  fusegraph cold   fresh FUSEGRAPH_CACHE_DIR and TRITON_CACHE_DIR (temp dirs): every kernel generated,
                   compiled and tuned
  fusegraph warm   a second process on the same dirs: tuning choices and compiled kernels from disk
  torch cold       torch.compile of the same block written in torch.nn.functional, fresh
                   TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
  torch warm       a second process on the same dirs (Inductor's FX-graph and Triton caches)
Times are wall seconds of g.build() (fusegraph) or of the first call (torch.compile compiles
there), each followed by one synchronized run; imports and tensor set-up are not counted.
Per kernel, fusegraph's Kernel.tuning says where the choice came from (default, launch-bound,
single, memo, cache, tuned), the seconds tuning took and the kernel's whole build time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

COLD_TIMEOUT_S, WARM_TIMEOUT_S = 75, 30   # per child: the four stay under 3 minutes


def child_fusegraph(size: str, dtype: str, profile: str | None = None, device: str = "cuda") -> dict[str, Any]:
    t_import = time.perf_counter()
    import torch

    from fusegraph.commands.demo_blocks import SIZES, transformer_block

    import_s = time.perf_counter() - t_import
    block = transformer_block(SIZES[size][0], getattr(torch, dtype), device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    plan = block.graph.build(device=device)
    build_s = time.perf_counter() - t0
    extra: dict[str, Any] = {"import_s": import_s}
    if profiler is not None:
        profiler.disable()
        extra.update(dump_cprofile(profiler, profile))
        build_profile = getattr(plan, "build_profile", None)
        if build_profile is not None:
            extra["build_profile"] = build_profile.as_dict()
            extra["build_profile_text"] = build_profile.report(top_kernels=40)
    t1 = time.perf_counter()
    out = plan.execute(block.feeds)[block.output]
    sync()
    first_call_s = time.perf_counter() - t1
    from fusegraph.commands.demo import exact_float32, rel_err
    with exact_float32():
        err = rel_err(out, block.eager_in(torch.float32))
    kernels = [{"name": k.name, "kind": k.kind, "backend": k.backend, "ops": len(k.nodes),
                "config": {a: v for a, v in k.config.items() if isinstance(v, int | float | str | bool)},
                "tuning": dict(getattr(k, "tuning", {}) or {})} for k in plan.kernels]
    return {"build_s": build_s, "first_call_s": first_call_s, "rel_err": err, "kernels": kernels, **extra}


def dump_cprofile(profiler: Any, label: str) -> dict[str, Any]:
    """The build's cProfile: top 30 by cumulative time (text, also in $OUT/compile_profile_<label>.txt)
    and the raw stats in $OUT/compile_profile_<label>.prof (snakeviz / pstats)."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(30)
    tottime = io.StringIO()
    pstats.Stats(profiler, stream=tottime).sort_stats("tottime").print_stats(15)
    out_dir = os.environ.get("OUT")
    if out_dir:
        stats.dump_stats(os.path.join(out_dir, f"compile_profile_{label}.prof"))
        with open(os.path.join(out_dir, f"compile_profile_{label}.txt"), "w") as f:
            f.write(text.getvalue() + "\n" + tottime.getvalue())
    return {"cprofile_top30": text.getvalue()}


def child_torch(size: str, dtype: str) -> dict[str, Any]:
    import torch

    from fusegraph.commands.demo_blocks import SIZES, transformer_block

    block = transformer_block(SIZES[size][0], getattr(torch, dtype), "cuda")
    tensors = block.named_tensors
    compiled = torch.compile(block.eager)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    compiled(tensors)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    compiled(tensors)
    torch.cuda.synchronize()
    steady_s = time.perf_counter() - t1
    return {"build_s": first_s - steady_s, "first_call_s": first_s, "torch": torch.__version__}


def run_child(which: str, env: dict[str, str], size: str, dtype: str, timeout: float,
              profile: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", which, "--size", size, "--dtype", dtype]
    if profile:
        cmd += ["--profile-label", profile]
        env = dict(env, FUSEGRAPH_PROFILE_BUILD="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-1500:]
        return {"error": f"timed out after {timeout:.0f} s; stderr tail: {tail!r}"}
    wall = time.perf_counter() - t0
    sys.stderr.write(proc.stderr[-4000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}", "process_s": wall}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    result["process_s"] = wall
    return result


def tuned_candidates(folder: str) -> list[dict[str, Any]]:
    """Every timed candidate of the cold build (the tuning cache's entries), printed fastest first:
    the data for ordering candidates (e.g. whether TMA tiles should come first)."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        timings = sorted(data.get("timings", []), key=lambda t: float("inf") if t["ms"] is None else t["ms"])
        out.append({"kernel": data["key"]["name"], "chosen": data["config"], "tuning_s": data.get("tuning_s"),
                    "timings": timings})
        print(f"  timed {data['key']['name']} in {data.get('tuning_s', 0):.2f} s:")
        for t in timings:
            what = f"{t['ms'] * 1e3:8.1f} us" if t["ms"] is not None else f"failed: {str(t['error'])[:80]}"
            print(f"      {what}  {t['config']}")
    return out


def print_fusegraph(label: str, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"{label}: FAILED {r['error'][:500]}")
        return
    print(f"{label}: build {r['build_s']:.2f} s, first call {r['first_call_s']:.3f} s, rel err {r['rel_err']:.2e}"
          f" (imports before the build {r.get('import_s', 0.0):.2f} s)")
    if "build_profile_text" in r:
        print(r["build_profile_text"])
        outside = r["build_s"] - r["build_profile"]["total_s"]
        print(f"  outside compile_graph: {outside:.3f} s (Graph.build's first import of the compiler modules, "
              f"to_ir)")
    if "cprofile_top30" in r:
        print(f"--- cProfile of the {label} build, top 30 by cumulative time ---")
        print(r["cprofile_top30"])
    for k in r["kernels"]:
        t = k["tuning"]
        if not t:
            continue
        print(f"    {k['name']:<40} {k['kind']:<11} {k['backend']:<8} {t.get('source', '?'):<12} "
              f"tune {t.get('seconds', 0):6.2f} s  build {t.get('build_s', t.get('seconds', 0)):6.2f} s  "
              f"({t.get('candidates', '?')} candidates)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", choices=("small", "medium"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--child", choices=("fusegraph", "torch"))
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="profile each fusegraph build: stage/kernel report and cProfile (stats to $OUT)")
    p.add_argument("--profile-label", help=argparse.SUPPRESS)
    p.add_argument("--child-device", default="cuda", help=argparse.SUPPRESS)   # cpu: a smoke run of the child
    args = p.parse_args()
    if args.child:
        result = child_fusegraph(args.size, args.dtype, args.profile_label, args.child_device) \
            if args.child == "fusegraph" \
            else child_torch(args.size, args.dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    root = tempfile.mkdtemp(prefix="fg_compile_time_")
    base = dict(os.environ)
    for var in ("FUSEGRAPH_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        base.pop(var, None)
    fg_env = dict(base, FUSEGRAPH_CACHE_DIR=os.path.join(root, "fg"), TRITON_CACHE_DIR=os.path.join(root, "fg_triton"))
    torch_env = dict(base, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                     TRITON_CACHE_DIR=os.path.join(root, "torch_triton"))
    record: dict[str, Any] = {"size": args.size, "dtype": args.dtype, "cpus": os.cpu_count(), "cache_root": root}
    t_all = time.perf_counter()
    record["fusegraph_cold"] = run_child("fusegraph", fg_env, args.size, args.dtype, COLD_TIMEOUT_S,
                                         "cold" if args.profile else None)
    print_fusegraph("fusegraph cold", record["fusegraph_cold"])
    record["tuned_candidates"] = tuned_candidates(os.path.join(root, "fg", "tune"))
    record["fusegraph_warm"] = run_child("fusegraph", fg_env, args.size, args.dtype, WARM_TIMEOUT_S,
                                         "warm" if args.profile else None)
    print_fusegraph("fusegraph warm", record["fusegraph_warm"])
    if not args.skip_torch:
        for label in ("torch_cold", "torch_warm"):
            r = record[label] = run_child("torch", torch_env, args.size, args.dtype,
                                          COLD_TIMEOUT_S if label == "torch_cold" else WARM_TIMEOUT_S)
            print(f"{label.replace('_', '.compile ')}: " + (f"FAILED {r['error'][:500]}" if "error" in r else
                  f"compile {r['build_s']:.2f} s (first call {r['first_call_s']:.2f} s)"))
    fc, fw = record["fusegraph_cold"], record["fusegraph_warm"]
    tc, tw = record.get("torch_cold", {}), record.get("torch_warm", {})
    if all("build_s" in r for r in (fc, fw, tc, tw)):
        record["ratios"] = {"cold_fusegraph_over_torch": fc["build_s"] / tc["build_s"],
                            "warm_fusegraph_over_torch": fw["build_s"] / tw["build_s"]}
        print(f"cold: fusegraph {fc['build_s']:.2f} s vs torch.compile {tc['build_s']:.2f} s "
              f"({record['ratios']['cold_fusegraph_over_torch']:.2f}x); warm: {fw['build_s']:.2f} s vs "
              f"{tw['build_s']:.2f} s (target: warm under 1 s)")
    record["total_s"] = time.perf_counter() - t_all
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "compile_time.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
