"""Triton's kernel cache written by LeanFileCacheManager (tune/triton_cache.py): the same files at the
same paths as Triton's own manager, atomic renames, nothing left behind, Triton's compile and its cache
lookups working through it, and install() leaving a user's own manager alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")
from triton import knobs
from triton.runtime.cache import FileCacheManager

from fusegraph.settings import override
from fusegraph.tune import triton_cache
from fusegraph.tune.triton_cache import LeanFileCacheManager


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_puts_the_same_files_as_tritons_manager(cache_dir: Path) -> None:
    blob, text = os.urandom(3000), "// ptx\n.version 8.4\n"
    ours, theirs = LeanFileCacheManager("k_lean"), FileCacheManager("k_triton")
    for manager in (ours, theirs):
        paths = {"kernel.cubin": manager.put(blob, "kernel.cubin"), "kernel.ptx": manager.put(text, "kernel.ptx")}
        manager.put_group("kernel.json", paths)
    lean, triton_tree = _tree(cache_dir / "k_lean"), _tree(cache_dir / "k_triton")
    assert lean.keys() == triton_tree.keys() == {"kernel.cubin", "kernel.ptx", "__grp__kernel.json"}
    assert lean["kernel.cubin"] == triton_tree["kernel.cubin"] == blob
    assert lean["kernel.ptx"] == triton_tree["kernel.ptx"] == text.encode()
    group = ours.get_group("kernel.json")
    assert group == {"kernel.cubin": str(cache_dir / "k_lean" / "kernel.cubin"),
                     "kernel.ptx": str(cache_dir / "k_lean" / "kernel.ptx")}
    assert [p.name for p in (cache_dir / "k_lean").iterdir() if p.is_dir()] == []   # no temporary directories
    # a second put replaces the file whole
    ours.put(b"new", "kernel.cubin")
    assert (cache_dir / "k_lean" / "kernel.cubin").read_bytes() == b"new"


def test_a_failed_write_raises_and_leaves_no_temporary_file(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = LeanFileCacheManager("k")
    manager.put(b"old", "kernel.cubin")

    def full_disk(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        manager.put(b"new", "kernel.cubin")
    assert sorted(p.name for p in (cache_dir / "k").iterdir()) == ["kernel.cubin"]
    assert (cache_dir / "k" / "kernel.cubin").read_bytes() == b"old"      # the old entry intact


def test_install_takes_the_place_only_of_tritons_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    monkeypatch.setattr(knobs.cache, "manager_class", None)
    with override(triton_lean_cache=False):
        assert not triton_cache.install() and knobs.cache.manager_class is None
    assert triton_cache.install() and knobs.cache.manager_class is LeanFileCacheManager
    assert triton_cache.install()                                   # installing again changes nothing

    class Mine(FileCacheManager):
        pass

    monkeypatch.setattr(knobs.cache, "manager_class", Mine)
    assert not triton_cache.install() and knobs.cache.manager_class is Mine      # the user's own stays
    monkeypatch.setattr(knobs.cache, "manager_class", None)
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    assert not triton_cache.install()


_COMPILE_TWICE = """
import sys, time
from triton import knobs
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from fusegraph.tune import triton_cache
knobs.cache.dir = sys.argv[1]
assert triton_cache.install()

@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(x + offs, mask=offs < n) + tl.load(y + offs, mask=offs < n), mask=offs < n)

src = ASTSource(fn=add, signature={"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                constexprs={"BLOCK": 256})
first = compile(src, target=GPUTarget("cuda", 90, 32))
calls = []
real = triton_cache.LeanFileCacheManager.put
triton_cache.LeanFileCacheManager.put = lambda self, *a, **k: calls.append(a[1]) or real(self, *a, **k)
again = compile(src, target=GPUTarget("cuda", 90, 32))
assert calls == [], calls                  # the second compile is a cache hit: nothing written
assert again.asm["ptx"] == first.asm["ptx"] and again.asm["cubin"] == first.asm["cubin"]
print("ok", sorted(first.asm))
"""


def test_tritons_compile_writes_and_finds_its_entries_through_it(tmp_path: Path) -> None:
    """A real compile for sm_90 (no GPU needed; in a process of its own, as the interpreter the tests
    run under cannot compile), then the same compile again: a cache hit on the files it wrote."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "compile_twice.py"   # @triton.jit needs its source in a file
    script.write_text(_COMPILE_TWICE)
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, env=env,
                          timeout=300)
    if done.returncode != 0 and "ptxas" in done.stderr:   # a Triton that cannot compile for CUDA here
        pytest.skip(f"cannot compile sm_90 here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok") and "cubin" in done.stdout
    leftovers = [p for p in cache.rglob("*") if p.name.endswith(".tmp") or p.name.startswith("tmp.pid_")]
    assert leftovers == []
