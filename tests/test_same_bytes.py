"""Same recipe, same bytes: a size run's file does not depend on the statistics cache or on the ranks (issue 71).

One size recipe per format (a GGUF at Q4_0's size, a compressed-tensors checkpoint at W4A16's) is run four
ways on a tiny Llama folder: with the cache on and empty (it measures and fills the cache), again (its prices
read from the cache, its moments measured again for the rounding), with ``use_cache=False`` (``--no-cache``:
measured afresh beside a filled cache), and under two gloo ranks (each measuring, pricing and rounding its
share); every written file is compared by sha256. The compressed-tensors folder is twice as wide as the GGUF
one: on the narrower one GPTQ's codes happened not to move when the cached run measured its moments as one
pass over every window where pricing had taken the mean of two cross-fitted halves. Every run is on one
intra-op thread (a batch's forward is bitwise reproducible only at a fixed thread count), as each rank is.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import compressor

pytestmark = pytest.mark.usefixtures("torch_single_thread")

WORLD = 2
#: format → (output.size, hidden size of the tiny Llama).
SIZES = {"gguf": ("Q4_0", 128), "compressed-tensors": ("W4A16", 128)}


def _folder(root: Path, hidden: int) -> Path:
    """A tiny Llama folder ``hidden`` wide (FFN twice that), its byte-level tokenizer and calibration and
    evaluation text, under ``root``."""
    import test_size_stream

    narrow = test_size_stream._tiny
    test_size_stream._tiny = lambda model_type: narrow(model_type, hidden_size=hidden, intermediate_size=2 * hidden)
    try:
        return test_size_stream._folder(root)
    finally:
        test_size_stream._tiny = narrow


def _recipe(root: Path, fmt: str, out: str, cache: bool):
    size, _ = SIZES[fmt]
    return compressor.recipe_from_dict({
        "model": {"source": str(root / "src"), "dtype": "float32"},
        "calibration": {"dataset": str(root / "cal.txt"), "max_tokens": 1024, "seq_len": 32},
        "evaluation": {"dataset": str(root / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": {"ppl_budget": 5.0}, "measure": {"cache": cache},
        "output": {"path": str(root / out), "size": size, "formats": [fmt], "dtype": "float32"},
    })


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every weight file under ``folder`` (GGUF, safetensors), by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.suffix in (".gguf", ".safetensors")}


def _rank_main(rank: int, port: int, root: str) -> None:
    """One of two gloo ranks: each format's size run, measured (no cache) and shared between the ranks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TQDM_DISABLE="1",
                      COMPRESSOR_CACHE=str(Path(root) / "ranks-cache"))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        codes = {fmt: compressor.run(_recipe(Path(root) / fmt, fmt, "ranks", cache=False)).exit_code
                 for fmt in SIZES}
        torch.save(codes, Path(root) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """Each format's folder, and its size run under two ranks (one spawn for both: starting processes costs)."""
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("same-bytes")
    for fmt, (_, hidden) in SIZES.items():
        (root / fmt).mkdir()
        _folder(root / fmt, hidden)
    mp.spawn(_rank_main, args=(_free_port(), str(root)), nprocs=WORLD, join=True)
    for r in range(WORLD):
        assert torch.load(root / f"rank{r}.pt") == dict.fromkeys(SIZES, 0)
        (root / f"rank{r}.pt").unlink()
    assert not (root / "ranks-cache").exists()  # no cache read or written
    return root


@pytest.mark.parametrize("fmt", sorted(SIZES))
def test_cached_uncached_no_cache_and_two_ranks_write_the_same_bytes(ranks, fmt, monkeypatch):
    root = ranks / fmt
    monkeypatch.setenv("COMPRESSOR_CACHE", str(root / "cache"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    runs = {"fills": {}, "reads": {}, "no-cache": {"use_cache": False}}
    for out, kw in runs.items():
        res = compressor.run(_recipe(root, fmt, out, cache=True), **kw)
        assert res.exit_code == 0, res.report.get("message")
        runs[out] = res.report["size_plan"]["prices_from_cache"]
    # the second run read what the first stored; --no-cache measured again beside it
    assert runs == {"fills": False, "reads": True, "no-cache": False}
    digests = {out: _digests(root / out) for out in (*runs, "ranks")}
    assert digests["fills"], "no weight file written"
    for out, d in digests.items():
        assert d == digests["fills"], f"{fmt}: the {out!r} run wrote other bytes than the first run"
