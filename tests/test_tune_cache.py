"""The tuning cache on disk: round trip, corrupt entries rebuilt, concurrent processes, version changes."""

from __future__ import annotations

import copy
import json
import multiprocessing
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fusegraph.settings import override
from fusegraph.tune import CacheEntry, CacheWarning, Config, Timing, TuneCache
from fusegraph.tune.keys import SCHEMA_VERSION, canonical, digest, full_key

GPU = {"name": "Fake GPU H200", "capability": "9.0"}
VERSIONS = {"fusegraph": "0.1.0", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8", "cudnn": "91000",
            "python": "3.12.0"}
CANDIDATES = [Config.of(BLOCK_C=1024, num_warps=8), Config.of(BLOCK_C=2048, num_warps=16)]


def make_key(name: str = "fused_layernorm_0", shape: tuple[int, ...] = (4096, 4096), **versions: str) -> dict:
    return full_key(name, {"sig": "abc123", "shape": shape, "dtype": torch.bfloat16}, CANDIDATES, GPU,
                    {**VERSIONS, **versions})


def make_entry(config: Config = CANDIDATES[1]) -> CacheEntry:
    return CacheEntry(config, (Timing(CANDIDATES[0], 0.25), Timing(config, 0.125),
                               Timing(Config.of(BLOCK_C=8192), None, "OutOfResources: shared memory")), 1.5)


def test_config_is_plain_hashable_data():
    a = Config.of(BLOCK_C=1024, num_warps=8, ONE_PASS=True)
    assert a == Config({"num_warps": 8, "ONE_PASS": True, "BLOCK_C": 1024}) == Config(values=a.to_json())
    assert hash(a) == hash(Config(a.values)) and len({a, Config(a.values)}) == 1
    assert a["BLOCK_C"] == 1024 and a.get("num_stages", 2) == 2 and "num_warps" in a
    assert dict(a) == {"BLOCK_C": 1024, "num_warps": 8, "ONE_PASS": True}
    assert a.replace(num_warps=4)["num_warps"] == 4 and a["num_warps"] == 8
    assert Config.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert Config.of(flag=True) != Config.of(flag=1)
    assert (lambda **kw: kw)(**a) == dict(a)  # usable as launch keyword arguments
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a
    with pytest.raises(KeyError, match="BLOCK_R"):
        a["BLOCK_R"]
    with pytest.raises(TypeError, match="values must be"):
        Config.of(BLOCK=[1, 2])
    with pytest.raises(AttributeError):
        a.values = {}  # type: ignore[misc]


def test_key_canonical_and_sensitive():
    assert make_key() == make_key()
    assert digest(make_key()) == digest(json.loads(json.dumps(make_key())))
    assert canonical({"s": torch.Size([2, 3]), "d": torch.float16, "t": (1, "a"), "n": np.int64(7)}) == \
        {"d": "float16", "n": 7, "s": [2, 3], "t": [1, "a"]}
    different = [make_key(shape=(4096, 4097)), make_key(name="other"), make_key(torch="2.12.0"),
                 make_key(triton="3.7.0"), make_key(fusegraph="0.2.0"), make_key(cuda="13.0"), make_key(cudnn="9")]
    assert len({digest(k) for k in [make_key(), *different]}) == 1 + len(different)
    assert digest(full_key("k", {}, CANDIDATES[:1], GPU, VERSIONS)) != digest(full_key("k", {}, CANDIDATES, GPU,
                                                                                         VERSIONS))
    assert digest(full_key("k", {}, CANDIDATES, {"name": "A100", "capability": "8.0"}, VERSIONS)) != \
        digest(full_key("k", {}, CANDIDATES, GPU, VERSIONS))
    with pytest.raises(TypeError, match="cannot be part of a tuning key"):
        full_key("k", {"fn": object()}, CANDIDATES, GPU, VERSIONS)


def test_roundtrip(tmp_path: Path):
    cache = TuneCache(tmp_path)
    key = make_key()
    assert cache.load(key) is None
    path = cache.store(key, make_entry())
    assert path == tmp_path / (digest(key) + ".json") and path.exists()
    got = cache.load(key)
    assert got is not None and got.config == CANDIDATES[1]
    assert got.timings == make_entry().timings and got.tuning_s == 1.5
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION and data["key"] == key and data["key"]["name"] == "fused_layernorm_0"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left behind


def test_default_directory_follows_settings(tmp_path: Path):
    with override(cache_dir=str(tmp_path / "c")):
        assert TuneCache().directory == tmp_path / "c" / "tune"
        TuneCache().store(make_key(), make_entry())
    assert len(list((tmp_path / "c" / "tune").glob("*.json"))) == 1


@pytest.mark.parametrize("content", [
    b"\x00\xff\xfe garbage \x89PNG",
    b"",
    None,  # truncated: the first half of a real entry
    b'{"schema": 999, "key": null, "config": {"BLOCK_C": 1}}',
    b"[1, 2, 3]",
    b'{"schema": %d, "key": {"name": "another kernel"}, "config": {"BLOCK_C": 1}}' % SCHEMA_VERSION,
    None,  # the right key but a config that is not an object
], ids=["garbage", "empty", "truncated", "wrong-schema", "not-object", "key-mismatch", "bad-config"])
def test_corrupt_entry_is_deleted_with_warning_and_rebuilt(tmp_path: Path, content: bytes | None, request):
    cache = TuneCache(tmp_path)
    key = make_key()
    path = cache.store(key, make_entry())
    assert path is not None
    if request.node.callspec.id == "truncated":
        content = path.read_bytes()[: path.stat().st_size // 2]
    elif request.node.callspec.id == "bad-config":
        data = json.loads(path.read_text())
        data["config"] = [1024, 8]
        content = json.dumps(data).encode()
    path.write_bytes(content)
    with pytest.warns(CacheWarning, match="corrupt"):
        assert cache.load(key) is None
    assert not path.exists()
    assert cache.store(key, make_entry()) == path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cache.load(key)
    assert got is not None and got.config == CANDIDATES[1]


def test_version_change_is_a_miss(tmp_path: Path):
    cache = TuneCache(tmp_path)
    cache.store(make_key(), make_entry())
    for changed in (make_key(torch="2.12.0"), make_key(triton="3.7.0"), make_key(fusegraph="0.2.0")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a miss, not a corrupt entry
            assert cache.load(changed) is None
    assert cache.load(make_key()) is not None


def test_unwritable_directory_warns_instead_of_failing(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(CacheWarning, match="cannot write"):
        assert TuneCache(blocker / "tune").store(make_key(), make_entry()) is None


def test_clear_and_scan(tmp_path: Path):
    cache = TuneCache(tmp_path)
    cache.store(make_key("a"), make_entry())
    cache.store(make_key("a", shape=(8, 8)), make_entry())
    cache.store(make_key("b"), make_entry())
    (tmp_path / ("0" * 64 + ".json")).write_text("{broken")
    found = list(cache.scan())
    assert sorted(f.name for f in found if f.name) == ["a", "a", "b"]
    assert sum(f.problem is not None for f in found) == 1
    assert cache.clear(name="b") == 1
    assert cache.clear() == 3
    assert cache.entry_paths() == []


# --- concurrent processes ---------------------------------------------------------------------------------

N_PROCESSES = 6
ROUNDS = 40
SHARED_KEYS = 3


def _writer_reader(directory: str, worker: int, queue) -> None:
    """Write and read shared and private keys; report every corrupt read this process saw."""
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = TuneCache(directory)
        for i in range(ROUNDS):
            names = [f"shared{i % SHARED_KEYS}", f"private{worker}_{i % 4}"]
            for name in names:
                key = make_key(name)
                # big, writer-specific payloads make a torn or interleaved write visible
                timings = tuple(Timing(Config.of(BLOCK_C=1024, writer=worker, i=j), 0.5 + j) for j in range(200))
                cache.store(key, CacheEntry(Config.of(BLOCK_C=1024 * (1 + worker)), timings, float(worker)))
                got = cache.load(key)
                if got is None:
                    problems.append(f"{name}: missing right after store")
                elif got.config["BLOCK_C"] != 1024 * (1 + int(got.tuning_s)) or \
                        any(t.config["writer"] != int(got.tuning_s) for t in got.timings):
                    problems.append(f"{name}: entry mixes writers")
        problems += [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    queue.put((worker, problems))


def test_concurrent_writers_and_readers_never_corrupt(tmp_path: Path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_writer_reader, args=(str(tmp_path), w, queue)) for w in range(N_PROCESSES)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(not problems for problems in results.values()), results
    cache = TuneCache(tmp_path)
    paths = cache.entry_paths()
    assert len(paths) == SHARED_KEYS + 4 * N_PROCESSES
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    for path in paths:
        data = json.loads(path.read_text())
        assert path.stem == digest(data["key"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entry = cache.load(data["key"])
        assert entry is not None and entry.config == Config.from_json(data["config"])
