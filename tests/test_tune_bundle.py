"""Cache bundles (tune/bundle.py, `fusegraph cache export|import`): one machine's tuning entries,
chosen cuDNN plans and (with --triton) Triton's compiled kernels carried to another machine's caches:
round trip, local entries never replaced, unreadable entries skipped, members outside the cache
places refused, a damaged or foreign file a clear error, other GPUs or library versions a warning."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from fusegraph.backends import cudnn_plans
from fusegraph.cli import main
from fusegraph.errors import InvalidValueError
from fusegraph.settings import override
from fusegraph.tune import CacheEntry, Config, TuneCache, bundle
from fusegraph.tune.keys import full_key, library_versions

GPU = {"name": "Fake GPU", "capability": "9.0"}
CANDIDATES = [Config.of(BLOCK_C=1024), Config.of(BLOCK_C=2048)]


@pytest.fixture
def machines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two machines' cache dirs (and Triton cache dirs); the first has entries, a plan and a kernel."""
    triton_dirs = {"a": tmp_path / "a_triton", "b": tmp_path / "b_triton"}
    current = {"machine": "a"}
    monkeypatch.setattr(bundle, "triton_cache_dir", lambda: triton_dirs[current["machine"]])

    def on(machine: str) -> Any:
        current["machine"] = machine
        return override(cache_dir=str(tmp_path / machine))

    with on("a"):
        cache = TuneCache()
        for shape in (4096, 8192):
            cache.store(full_key("fused_softmax_0", {"shape": shape}, CANDIDATES, GPU), CacheEntry(CANDIDATES[1]))
        key = cudnn_plans.store_key([], GPU, "91900")
        cudnn_plans.store(key, 0, 2, b"serialized plan bytes")
        group = triton_dirs["a"] / "ABCDEF0123"
        group.mkdir(parents=True)
        (group / "fg_softmax.cubin").write_bytes(b"\x7fELF cubin")
        (group / "fg_softmax.json").write_text("{}")
        (triton_dirs["a"] / "LAUNCHER99").mkdir()
        (triton_dirs["a"] / "LAUNCHER99" / "launcher.so").write_bytes(b"host code")   # not carried
    return on, triton_dirs


def test_round_trip_to_an_empty_machine(machines: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    on, triton_dirs = machines
    path = tmp_path / "tuned.tar.gz"
    with on("a"):
        assert main(["cache", "export", str(path), "--triton"]) == 0
        assert "2 tuning entries, 1 cuDNN plans, 2 Triton cache files" in capsys.readouterr().out
        made = sorted(p.name for p in TuneCache().entry_paths())
    with on("b"):
        assert main(["cache", "import", str(path)]) == 0
        assert "5 added, 0 already here (kept), 0 unreadable (skipped)" in capsys.readouterr().out
        assert sorted(p.name for p in TuneCache().entry_paths()) == made
        got = TuneCache().load(full_key("fused_softmax_0", {"shape": 4096}, CANDIDATES, GPU))
        assert got is not None and got.config == CANDIDATES[1]
        assert cudnn_plans.load(cudnn_plans.store_key([], GPU, "91900")) == (0, 2, b"serialized plan bytes")
        assert (triton_dirs["b"] / "ABCDEF0123" / "fg_softmax.cubin").read_bytes() == b"\x7fELF cubin"
        assert not (triton_dirs["b"] / "LAUNCHER99").exists()
        assert main(["cache", "import", str(path)]) == 0                      # again: nothing replaced
        assert "0 added, 5 already here (kept)" in capsys.readouterr().out


def test_local_entries_are_kept_and_unreadable_ones_skipped(machines: Any, tmp_path: Path) -> None:
    on, _ = machines
    path = tmp_path / "tuned.tar.gz"
    damaged = full_key("fused_softmax_0", {"shape": 4096}, CANDIDATES, GPU)
    mine = full_key("fused_softmax_0", {"shape": 8192}, CANDIDATES, GPU)
    with on("a"):
        TuneCache().path_for(damaged).write_bytes(b"\x00 damaged on disk")   # exported as it is
        bundle.export_bundle(path)
    with on("b"):
        TuneCache().store(mine, CacheEntry(CANDIDATES[0]))                   # this machine's own choice
        got = bundle.import_bundle(path)
        assert (got["added"], got["kept"], got["skipped"]) == (1, 1, 1)     # the plan; mine; the damaged one
        entry = TuneCache().load(mine)
        assert entry is not None and entry.config == CANDIDATES[0]          # not replaced by the bundle's
        assert not TuneCache().path_for(damaged).exists()


def _bundle_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes]],
                 manifest: dict[str, Any] | None = None) -> None:
    with tarfile.open(path, "w:gz") as tar:
        data = json.dumps(manifest or {"schema": bundle.SCHEMA, "versions": library_versions(), "gpu": None}).encode()
        info = tarfile.TarInfo(bundle.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for info, payload in members:
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


@pytest.mark.parametrize("name, kind", [("tune/../../escaped.json", tarfile.REGTYPE),
                                        ("/etc/passwd", tarfile.REGTYPE),
                                        ("triton/abc/../../x", tarfile.REGTYPE),
                                        ("tune/" + "a" * 64 + ".json", tarfile.SYMTYPE),
                                        ("notes/readme.txt", tarfile.REGTYPE)])
def test_members_outside_the_cache_places_are_refused(machines: Any, tmp_path: Path, name: str, kind: bytes) -> None:
    on, _ = machines
    path = tmp_path / "evil.tar.gz"
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
    _bundle_with(path, [(info, b"payload")])
    with on("b"), pytest.raises(InvalidValueError, match="member"):
        bundle.import_bundle(path)
    assert not (tmp_path / "escaped.json").exists() and not list(tmp_path.rglob("x"))


def test_a_damaged_or_foreign_file_is_a_clear_error(machines: Any, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    on, _ = machines
    good = tmp_path / "tuned.tar.gz"
    with on("a"):
        bundle.export_bundle(good)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    text = tmp_path / "notes.txt"
    text.write_text("not a bundle")
    old = tmp_path / "old.tar.gz"
    _bundle_with(old, [], {"schema": 99})
    with on("b"):
        for path, message in ((cut, "damaged|not a readable"), (text, "not a readable"), (old, "schema 99"),
                              (tmp_path / "missing.tar.gz", "not a readable")):
            with pytest.raises(InvalidValueError, match=message):
                bundle.import_bundle(path)
        assert main(["cache", "import", str(text)]) == 2
        assert "error: cache bundle" in capsys.readouterr().err


def test_another_gpu_or_library_build_is_a_warning(machines: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from fusegraph.tune import keys

    on, _ = machines
    path = tmp_path / "other.tar.gz"
    _bundle_with(path, [], {"schema": bundle.SCHEMA, "versions": {**library_versions(), "torch": "1.0.0"},
                            "gpu": {"name": "Other GPU", "capability": "8.0"}})
    monkeypatch.setattr(keys, "gpu_identity", lambda: GPU)
    with on("b"):
        warnings = bundle.import_bundle(path)["warnings"]
    assert any("library versions (torch)" in w for w in warnings)
    assert any("made on Other GPU, this GPU is Fake GPU" in w for w in warnings)
