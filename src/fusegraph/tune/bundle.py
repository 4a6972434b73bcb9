"""Cache bundles: one machine's tuning results in a single file, for another machine with the same
GPU model and libraries, whose first compile then takes the choices instead of timing them.

    fusegraph cache export tuned.tar.gz [--triton]     # tuning choices and chosen cuDNN plans (and
                                                       # Triton's compiled kernels with --triton)
    fusegraph cache import tuned.tar.gz                # on the other machine

A bundle is a gzipped tar: `manifest.json` (schema, library versions, GPU, what it holds), then
`tune/<sha256>.json` (autotuner entries, tune/cache.py), `cudnn_plans/<sha256>.plan` (chosen cuDNN
plans, backends/cudnn_plans.py) and, with --triton, `triton/<hash>/<file>` (Triton's cache groups:
compiled kernels and their metadata; not the host-compiled launcher and driver modules, `.so` files
built for this machine's Python and C library, which the other machine builds itself).

Every entry keeps the key it was made under (GPU, library versions), so an entry from another GPU
or library build is simply never used; importing into such a machine says so. Importing never
overwrites a local entry (this machine's own choices stay), checks each entry as the cache would
read it (an entry that does not parse is skipped and counted), writes each file atomically, and
refuses archive members that are not plain files at the expected places (a path leaving the cache
directory, a link, a device).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
import zlib
from pathlib import Path
from typing import Any

from ..errors import InvalidValueError
from .cache import TuneCache, _check_entry, write_atomically

MANIFEST = "manifest.json"
SCHEMA = 1
_HEX_NAME = re.compile(r"^[0-9a-f]{64}\.(json|plan)$")
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def triton_cache_dir() -> Path:
    """Where Triton keeps its compiled kernels (TRITON_CACHE_DIR, else its default)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except Exception:  # an older Triton without knobs
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def export_bundle(path: str | os.PathLike[str], *, triton: bool = False) -> dict[str, Any]:
    """Write this machine's tuning entries and chosen cuDNN plans (and Triton's kernels with `triton`)
    to `path`, written atomically; returns the manifest."""
    from ..backends import cudnn_plans
    from . import keys

    tune_files = TuneCache().entry_paths()
    plan_files = cudnn_plans.stored()
    triton_files = _triton_files() if triton else []
    manifest = {
        "schema": SCHEMA,
        "created": time.time(),
        "versions": keys.canonical(keys.library_versions()),
        "gpu": keys.gpu_identity(),
        "tune": len(tune_files),
        "cudnn_plans": len(plan_files),
        "triton_files": len(triton_files),
    }
    root = triton_cache_dir()
    members = [(f, f"tune/{f.name}") for f in tune_files] + [(f, f"cudnn_plans/{f.name}") for f in plan_files] \
        + [(f, f"triton/{f.relative_to(root).as_posix()}") for f in triton_files]
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")   # streamed to disk (a Triton cache can be
    try:                                                            # large), then renamed into place
        with tarfile.open(tmp, mode="w:gz") as tar:
            _add_bytes(tar, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            for file, name in members:
                try:
                    tar.add(file, arcname=name, recursive=False)
                except FileNotFoundError:   # removed since it was listed (another process cleared it)
                    continue
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


def import_bundle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Add a bundle's entries to this machine's caches (never replacing an existing one); returns
    counts of what was added, kept (already here) and skipped (unreadable), the bundle's manifest,
    and warnings (another GPU or library versions: its entries will not be used here)."""
    from . import keys

    counts = {"added": 0, "kept": 0, "skipped": 0}
    try:
        tar = tarfile.open(path, mode="r:gz")   # noqa: SIM115  (closed by the with below; its error is ours)
    except (OSError, tarfile.TarError, EOFError) as err:
        raise InvalidValueError(f"cache bundle {os.fspath(path)!r} is not a readable .tar.gz: {err}") from err
    with tar:
        try:
            manifest = _manifest(tar, path)
            _add_members(tar, path, counts)
        except (OSError, tarfile.TarError, EOFError, zlib.error) as err:   # truncated or corrupt past its start
            raise InvalidValueError(f"cache bundle {os.fspath(path)!r} is damaged ({type(err).__name__}: {err}); "
                                    f"imported before that: {counts}") from err
    warnings = []
    here = keys.canonical(keys.library_versions())
    if manifest.get("versions") != here:
        differ = sorted(k for k in set(here) | set(manifest.get("versions") or {})
                        if (manifest.get("versions") or {}).get(k) != here.get(k))
        warnings.append(f"made with other library versions ({', '.join(differ)}): its entries are not used here")
    gpu = keys.gpu_identity()
    if gpu is not None and manifest.get("gpu") not in (None, gpu):
        warnings.append(f"made on {manifest['gpu'].get('name')}, this GPU is {gpu.get('name')}: its entries are "
                        "not used here")
    return {**counts, "manifest": manifest, "warnings": warnings}


def _add_members(tar: tarfile.TarFile, path: Any, counts: dict[str, int]) -> None:
    from ..backends import cudnn_plans

    tune_dir, plan_dir, triton_dir = TuneCache().directory, cudnn_plans.directory(), triton_cache_dir()
    for member in tar.getmembers():
        if member.name == MANIFEST:
            continue
        target, check = _place(member, path, tune_dir, plan_dir, triton_dir)
        if target.exists():
            counts["kept"] += 1
            continue
        handle = tar.extractfile(member)
        data = handle.read() if handle is not None else b""
        if not check(data, target):
            counts["skipped"] += 1
            continue
        write_atomically(target, data)
        counts["added"] += 1


def _manifest(tar: tarfile.TarFile, path: Any) -> dict[str, Any]:
    try:
        member = tar.getmember(MANIFEST)
        handle = tar.extractfile(member)
        manifest = json.loads(handle.read() if handle is not None else b"")
    except (KeyError, ValueError, tarfile.TarError) as err:
        raise InvalidValueError(f"cache bundle {os.fspath(path)!r} has no readable {MANIFEST}: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise InvalidValueError(f"cache bundle {os.fspath(path)!r}: schema {manifest.get('schema')!r} "
                                f"(this fusegraph reads {SCHEMA})" if isinstance(manifest, dict) else
                                f"cache bundle {os.fspath(path)!r}: {MANIFEST} is not an object")
    return manifest


def _place(member: tarfile.TarInfo, path: Any, tune_dir: Path, plan_dir: Path, triton_dir: Path) -> tuple[Path, Any]:
    """Where a member goes and how its bytes are checked; InvalidValueError for anything else."""
    parts = member.name.split("/")
    if not member.isreg() or any(not _SAFE_PART.match(p) for p in parts):
        raise InvalidValueError(f"cache bundle {os.fspath(path)!r}: member {member.name!r} is not a plain file "
                                "at a cache path; nothing after it was imported")
    if len(parts) == 2 and parts[0] == "tune" and _HEX_NAME.match(parts[1]) and parts[1].endswith(".json"):
        return tune_dir / parts[1], _tune_entry_ok
    if len(parts) == 2 and parts[0] == "cudnn_plans" and _HEX_NAME.match(parts[1]) and parts[1].endswith(".plan"):
        return plan_dir / parts[1], _plan_ok
    if len(parts) == 3 and parts[0] == "triton":
        return triton_dir / parts[1] / parts[2], lambda data, target: True
    raise InvalidValueError(f"cache bundle {os.fspath(path)!r}: unexpected member {member.name!r}")


def _tune_entry_ok(data: bytes, target: Path) -> bool:
    try:
        entry = json.loads(data.decode("ascii"))
        _check_entry(entry, expected_key=entry["key"], file_stem=target.stem)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return False
    return True


def _plan_ok(data: bytes, target: Path) -> bool:
    """A stored plan file that parses, named for the key in its header."""
    from ..backends import cudnn_plans

    try:
        key = cudnn_plans.parse_entry(data)[0]
        return cudnn_plans.file_name(key) == target.name
    except (ValueError, TypeError):
        return False


def _triton_files() -> list[Path]:
    root = triton_cache_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/*") if p.is_file() and not p.name.startswith(".")
                  and p.suffix not in (".tmp", ".so") and _SAFE_PART.match(p.parent.name) and _SAFE_PART.match(p.name))


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))
