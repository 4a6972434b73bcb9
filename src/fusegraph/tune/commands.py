"""`fusegraph cache info|clear|export|import`: look at, empty and carry the tuning cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from .cache import TuneCache


def add_parser(subparsers: Any) -> None:
    cache = subparsers.add_parser("cache", help="inspect or clear the autotuning cache",
                                  description="The autotuning cache: one file per tuned kernel, shape and "
                                  "GPU, under FUSEGRAPH_CACHE_DIR.")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    cache.set_defaults(func=lambda args: (cache.print_help(), 0)[1])

    info = cache_sub.add_parser("info", help="where the cache is, how many entries, for which kernels")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.set_defaults(func=run_info)

    clear = cache_sub.add_parser("clear", help="remove cached tuning choices (and the chosen cuDNN plans)")
    clear.add_argument("--stale", action="store_true",
                       help="remove only entries from other library versions and unreadable ones")
    clear.add_argument("--name", metavar="KERNEL", help="remove only the entries of this kernel")
    clear.set_defaults(func=run_clear)

    export = cache_sub.add_parser("export", help="write the tuning choices and chosen cuDNN plans to one file, "
                                  "for another machine with the same GPU and libraries",
                                  description="Writes a cache bundle (tune/bundle.py): the tuning entries and "
                                  "chosen cuDNN plans of this machine, and with --triton Triton's compiled "
                                  "kernels. `fusegraph cache import` on another machine adds them to its caches.")
    export.add_argument("path", help="the bundle to write (a .tar.gz)")
    export.add_argument("--triton", action="store_true",
                        help="include Triton's compiled kernels (its whole cache directory: can be large)")
    export.set_defaults(func=run_export)

    imp = cache_sub.add_parser("import", help="add a cache bundle's entries to this machine's caches",
                               description="Adds the entries of a bundle made by `fusegraph cache export`, "
                               "never replacing one this machine has; entries that do not parse are skipped.")
    imp.add_argument("path", help="the bundle to read")
    imp.set_defaults(func=run_import)


def cache_summary(cache: TuneCache) -> dict[str, Any]:
    from ..backends import cudnn_plans

    found = list(cache.scan())
    per_kernel = Counter(f.name for f in found if f.name is not None)
    plans = cudnn_plans.stored()
    return {
        "cudnn_plans": len(plans),
        "cudnn_plan_bytes": sum(p.stat().st_size for p in plans),
        "directory": str(cache.directory),
        "entries": len(found),
        "bytes": sum(f.size for f in found),
        "stale": sum(f.stale for f in found),
        "corrupt": sum(f.problem is not None for f in found),
        "kernels": dict(sorted(per_kernel.items())),
    }


def run_info(args: argparse.Namespace) -> int:
    summary = cache_summary(TuneCache())
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"cache directory: {summary['directory']}")
    print(f"entries: {summary['entries']} ({_size(summary['bytes'])})")
    if summary["cudnn_plans"]:
        print(f"cuDNN plans (chosen, serialized): {summary['cudnn_plans']} ({_size(summary['cudnn_plan_bytes'])})")
    if summary["stale"]:
        print(f"stale (other library versions): {summary['stale']}")
    if summary["corrupt"]:
        print(f"unreadable: {summary['corrupt']} (rebuilt when used; `fusegraph cache clear --stale` removes them)")
    if summary["kernels"]:
        width = max(len(name) for name in summary["kernels"])
        print("entries per kernel:")
        for name, count in summary["kernels"].items():
            print(f"  {name:<{width}}  {count}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from ..backends import cudnn_plans

    cache = TuneCache()
    removed = cache.clear(stale_only=args.stale, name=args.name)
    what = "stale or unreadable " if args.stale else ""
    of = f" of kernel {args.name!r}" if args.name else ""
    print(f"removed {removed} {what}{'entry' if removed == 1 else 'entries'}{of} from {cache.directory}")
    if not args.stale and not args.name:   # the chosen cuDNN plans are tuning results too
        plans = cudnn_plans.clear()
        print(f"removed {plans} cuDNN plan{'' if plans == 1 else 's'} from {cudnn_plans.directory()}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from .bundle import export_bundle

    try:
        manifest = export_bundle(args.path, triton=args.triton)
    except OSError as err:
        print(f"error: cannot write {args.path}: {err}", file=sys.stderr)
        return 1
    extra = f", {manifest['triton_files']} Triton cache files" if args.triton else ""
    print(f"wrote {args.path}: {manifest['tune']} tuning entries, {manifest['cudnn_plans']} cuDNN plans{extra} "
          f"({_size(os.path.getsize(args.path))})")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ..errors import InvalidValueError
    from .bundle import import_bundle

    try:
        got = import_bundle(args.path)
    except InvalidValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"imported {args.path}: {got['added']} added, {got['kept']} already here (kept), "
          f"{got['skipped']} unreadable (skipped)")
    for warning in got["warnings"]:
        print(f"warning: {warning}")
    return 0


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024 or unit == "MiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
