"""The statistics cache: where it lives, generic put/get, LRU cap, `compressor cache info|clear`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from test_cli import isolated  # noqa: F401  (autouse fixture: logging restored, cache in tmp_path)

from compressor.engine import cache
from compressor.cli import main


@pytest.fixture
def cache_here(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "c"
    monkeypatch.setenv("COMPRESSOR_CACHE", str(d))
    monkeypatch.delenv("COMPRESSOR_CACHE_MAX_GB", raising=False)
    return d


def test_location_precedence(tmp_path, monkeypatch):
    for var in ("COMPRESSOR_CACHE", "COMPRESSOR_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "compressor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "compressor"
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "old"))
    assert cache.cache_dir() == tmp_path / "old"
    monkeypatch.setenv("COMPRESSOR_CACHE", str(tmp_path / "new"))
    assert cache.cache_dir() == tmp_path / "new"


def test_put_get_roundtrip_and_atomic(cache_here):
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.float64)}
    path = cache.put("k1", tensors, {"format": "x", "note": "hi"})
    assert path == cache_here / "k1.safetensors" and path.is_file()
    got, meta = cache.get("k1")
    assert meta == {"format": "x", "note": "hi"}
    assert set(got) == {"a", "b"} and torch.equal(got["a"], tensors["a"]) and got["b"].dtype == torch.float64
    assert cache.get("missing") is None
    assert [p.name for p in cache_here.iterdir()] == ["k1.safetensors"]  # no temporary file left
    with pytest.raises(ValueError, match="cache key"):
        cache.put("../escape", tensors)


def test_corrupt_entry_is_ignored(cache_here):
    cache_here.mkdir()
    (cache_here / "bad.safetensors").write_bytes(b"garbage")
    assert cache.get("bad") is None


def test_lru_eviction_respects_the_cap(cache_here, monkeypatch):
    t = {"x": torch.zeros(1000)}  # ~4 KB per entry
    for k in ("old", "mid", "new"):
        cache.put(k, t)
    now = 1_700_000_000
    for age, k in ((300, "old"), (200, "mid"), (100, "new")):
        os.utime(cache_here / f"{k}.safetensors", (now - age, now - age))
    cache.get("old")  # reading touches it: now the most recently used
    monkeypatch.setenv("COMPRESSOR_CACHE_MAX_GB", str(3 * 4200 / 1e9))  # room for three entries
    cache.put("newest", t)
    assert sorted(p.stem for p in cache_here.glob("*.safetensors")) == ["new", "newest", "old"]  # "mid" was LRU
    info = cache.info()
    assert info["entries"] == 3 and info["total_bytes"] <= info["max_bytes"]


def test_entry_larger_than_cap_is_not_stored(cache_here, monkeypatch):
    monkeypatch.setenv("COMPRESSOR_CACHE_MAX_GB", "0")
    assert cache.put("k", {"x": torch.zeros(10)}) is None
    assert not list(cache_here.glob("*.safetensors"))


def test_cli_cache_info_and_clear(cache_here, capsys, monkeypatch):
    cache.put("k1", {"x": torch.zeros(10)})
    cache.put("k2", {"x": torch.zeros(10)})
    (cache_here / "unrelated.txt").write_text("not ours")
    monkeypatch.setenv("COMPRESSOR_CACHE_MAX_GB", "2")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"location: {cache_here}" in out and "entries:  2" in out and "cap:      2.0 GB" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 2 cache entries" in capsys.readouterr().out
    assert [p.name for p in cache_here.iterdir()] == ["unrelated.txt"]  # only the cache's own files go


def test_stats_roundtrip_on_top_of_generic_layer(cache_here, tiny_model):
    from compressor.engine.measure import collect

    model = tiny_model("llama")
    ids = torch.randint(2, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    stats = collect(model, ids[:2], ids[2:])
    cache.save_stats("s1", stats)
    back = cache.load_stats("s1")
    assert sorted(back) == sorted(stats)
    assert torch.equal(back[0].fit.cxx, stats[0].fit.cxx)
    cache.put("s2", {"x": torch.zeros(1)}, {"format": "other"})
    assert cache.load_stats("s2") is None  # not a statistics entry
