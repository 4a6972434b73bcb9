"""Where a warm compile's time goes: the GPT-2 training step or ResNet-50 inference through
`fg.compile`, first in a fresh process on empty cache dirs (cold), then in a second process on the
same dirs (warm: tuning choices and Triton binaries on disk), one of them under cProfile (by
default the warm one, which that slows: `--profiled none` for unprofiled figures of both).

    PYTHONPATH=src python bench/warm_compile_gpu.py [--workload gpt2_train|resnet50|zoo:<model>]
                                                    [--profiled cold|warm|none] [--top 40]
                                                    [--build-profile] [--choices] [--sample cold|warm|both]

`zoo:<model>` compiles a model of bench/zoo_models.py (`python bench/zoo.py --list`) for inference in
bfloat16 at its default batch, as `bench/zoo.py` does.

Prints the wall seconds of each first call (compile included) and the profiled build's top functions
by cumulative time; the full stats go to $OUT/<cold|warm>_compile_<workload>.prof when OUT is set.
`--sample` runs a first call under StackSampler, a wall-clock sampler of every thread (cProfile sees only
its own thread): $OUT/<cold|warm>_sampled_<workload>.txt. The sampler takes the GIL every 5 ms, which
slows a build on many threads (MobileNetV3: 29.3 s sampled against 21.7-22.3 s), so compare its seconds
with each other, not with unsampled runs. Each run writes into $OUT, which must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time


class StackSampler:
    """A wall-clock sampling profiler of every thread (cProfile sees only the thread it runs in, and
    charges a C call with the time that thread then waits for the GIL): every `interval` seconds the
    stacks of all threads are read (sys._current_frames) and each sample weighted by the time since the
    previous one (a sample the GIL delayed counts for the whole delay). Main thread: seconds by function
    on the stack (inclusive) and by innermost function; other threads: by innermost function."""

    def __init__(self, interval: float = 0.005) -> None:
        import threading
        from collections import Counter

        self.interval, self.main = interval, threading.main_thread().ident
        self.inclusive: Counter[str] = Counter()
        self.innermost: Counter[str] = Counter()
        self.others: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")

    @staticmethod
    def _where(frame: object) -> str:
        code = frame.f_code  # type: ignore[attr-defined]
        parts = code.co_filename.split("/")
        short = "/".join(parts[parts.index("site-packages") + 1:] if "site-packages" in parts else parts[-2:])
        return f"{short}:{code.co_name}"

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.stop.wait(self.interval):
            now = time.perf_counter()
            weight, last = now - last, now
            for ident, frame in sys._current_frames().items():
                if ident == self.thread.ident:
                    continue
                top = self._where(frame)
                if ident != self.main:
                    self.others[top] += weight
                    continue
                self.innermost[top] += weight
                seen = set()
                f = frame
                while f is not None:
                    where = self._where(f)
                    if where not in seen:
                        seen.add(where)
                        self.inclusive[where] += weight
                    f = f.f_back

    def __enter__(self) -> StackSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def report(self, top: int = 45) -> str:
        lines = ["main thread, seconds with the function on the stack:"]
        lines += [f"  {s:8.2f}  {w}" for w, s in self.inclusive.most_common(top)]
        lines.append("main thread, seconds as the innermost function:")
        lines += [f"  {s:8.2f}  {w}" for w, s in self.innermost.most_common(top // 2)]
        lines.append("other threads (summed over threads), seconds as the innermost function:")
        lines += [f"  {s:8.2f}  {w}" for w, s in self.others.most_common(top // 2)]
        return "\n".join(lines) + "\n"


def child(workload: str, profile_path: str | None, sample_path: str | None = None,
          sample_interval: float = 0.005) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import targets_gpu as T
    import torch

    import fusegraph as fg

    T.S.device = "cuda"
    torch.manual_seed(0)
    if workload == "gpt2_train":
        model = T.LMWithLoss(T.gpt2("full")).cuda()
        ids = torch.randint(0, 50257, (8, 1024), device="cuda")
        step = T.TrainStep(model, fg.compile(model), ids, ids.roll(1, 1), torch.bfloat16)

        def first() -> None:
            step.loss_and_grads()
    elif workload.startswith("zoo:"):
        import zoo_models
        from zoo import randomize_zero_weights
        m = zoo_models.get(workload[4:])
        zoo_model = m.build("full").eval()
        randomize_zero_weights(zoo_model)
        zoo_model = zoo_model.cuda().to(torch.bfloat16)
        ex = m.example(None, torch.float32, "cuda", "full")
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in ex.inputs)
        compiled_zoo = fg.compile(zoo_model)

        def first() -> None:
            with torch.no_grad():
                compiled_zoo(*inputs)
    else:
        from zoo_models import ensure_torchvision_importable
        ensure_torchvision_importable()
        net = T.resnet50("full").eval().cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
        x = torch.randn(128, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
        compiled = fg.compile(net)

        def first() -> None:
            with torch.no_grad():
                compiled(x.contiguous(memory_format=torch.channels_last))
    torch.cuda.synchronize()
    profiler = None
    if profile_path:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    sampler = StackSampler(sample_interval) if sample_path else None
    start = time.perf_counter()
    with sampler or contextlib.nullcontext():
        first()
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if sampler is not None and sample_path:
        with open(sample_path, "w") as f:
            f.write(sampler.report())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    print(json.dumps({"first_call_s": seconds}))


def _summed_builds(stderr: str) -> float:
    """Seconds summed over the 'build profile of NAME: S s' headers FUSEGRAPH_PROFILE_BUILD prints."""
    import re
    return sum(float(m) for m in re.findall(r"^build profile of .*: ([0-9.]+) s$", stderr, flags=re.M))


def _choices(directory: str) -> str:
    """One block per tuning-cache entry: kernel, the GEMM's M N K when its source names them, tuning
    seconds, every candidate by time (the winner first), so a later analysis can rank the candidates
    as gemm_configs orders them for that shape."""
    import re

    blocks = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(directory, name)) as f:
            data = json.load(f)
        timings = sorted(data.get("timings", []), key=lambda t: (t.get("ms") is None, t.get("ms") or 0.0))
        problem = data["key"].get("key", {})
        dims = re.search(r"M, N, K = (\d+), (\d+), (\d+)", str(problem.get("source", ""))) \
            if isinstance(problem, dict) else None
        shape = f"  [M N K = {' '.join(dims.groups())}]" if dims else ""
        lines = [f"{data['key'].get('name')}{shape}  {len(timings)} candidates, tuned in "
                 f"{data.get('tuning_s', 0.0):.3f} s"]
        lines += [f"    {t['ms'] if t.get('ms') is not None else 'failed':>10}  {json.dumps(t.get('config'))}"
                  for t in timings]
        blocks.append("\n".join(lines))
    return "\n".join(blocks) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2_train", help="gpt2_train, resnet50 or zoo:<model>")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--profiled", choices=("cold", "warm", "none"), default="warm",
                        help="which of the two first calls runs under cProfile (which slows its Python-heavy "
                             "parts: compare a profiled call only with other profiled calls)")
    parser.add_argument("--build-profile", action="store_true",
                        help="FUSEGRAPH_PROFILE_BUILD=1 in both: each plan build's stages and kernels, "
                             "saved as $OUT/<cold|warm>_build_profile_<workload>.txt")
    parser.add_argument("--choices", action="store_true",
                        help="after the cold run, list every tuning choice (candidates, winner, times) in "
                             "$OUT/choices_<workload>.txt")
    parser.add_argument("--sample", choices=("cold", "warm", "both"), default=None,
                        help="run that first call under a sampling profiler of all threads (wall time, GIL waits "
                             "included): $OUT/<cold|warm>_sampled_<workload>.txt")
    parser.add_argument("--sample-interval", type=float, default=0.005,
                        help="seconds between samples (longer: less of the sampler's own GIL use, coarser figures)")
    parser.add_argument("--sample-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child", default="")
    parser.add_argument("--profile", default="")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.profile or None, args.sample_out or None, args.sample_interval)
        return 0
    out = os.environ.get("OUT") or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    if not (args.workload in ("gpt2_train", "resnet50") or args.workload.startswith("zoo:")):
        parser.error(f"--workload {args.workload!r}: gpt2_train, resnet50 or zoo:<model>")
    tag = args.workload.replace("zoo:", "zoo_")
    prof = os.path.join(out, f"{args.profiled}_compile_{tag}.prof")
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, FUSEGRAPH_CACHE_DIR=os.path.join(root, "fg"),
                   TRITON_CACHE_DIR=os.path.join(root, "triton"), TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "ind"))
        if args.build_profile:
            env["FUSEGRAPH_PROFILE_BUILD"] = "1"
        for label in ("cold", "warm"):
            extra = ["--profile", prof] if label == args.profiled else []
            if args.sample in (label, "both"):
                extra += ["--sample-out", os.path.join(out, f"{label}_sampled_{tag}.txt"),
                          "--sample-interval", str(args.sample_interval)]
            cmd = [sys.executable, os.path.abspath(__file__), "--child", args.workload, *extra]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode != 0 or not lines:
                print(f"{label}: failed (rc {done.returncode})\n{done.stderr[-3000:]}")
                return 1
            seconds = json.loads(lines[-1])["first_call_s"]
            print(f"{args.workload} {label}: first call {seconds:.2f} s", flush=True)
            if args.build_profile:
                report = os.path.join(out, f"{label}_build_profile_{tag}.txt")
                with open(report, "w") as f:
                    f.write(done.stderr)
                print(f"  plan builds: {_summed_builds(done.stderr):.2f} s of it (the rest: tracing, "
                      f"partitioning, capture, first runs); reports in {report}", flush=True)
            if args.choices and label == "cold":
                listing = os.path.join(out, f"choices_{tag}.txt")
                with open(listing, "w") as f:
                    f.write(_choices(os.path.join(root, "fg", "tune")))
                print(f"  tuning choices in {listing}", flush=True)
    if args.profiled == "none":
        return 0
    import pstats
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
