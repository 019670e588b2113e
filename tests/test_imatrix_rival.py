"""The right rival in every GGUF size run (issue 72, item 4), and ``output.size: smallest`` searching below its
first passing plan (issue 71, minor 5).

* the run's importance matrix is llama.cpp's imatrix GGUF (``general.type: imatrix``, ``<name>.in_sum2`` and
  ``<name>.counts`` F32, experts stacked ``[n_expert, n_cols]``), and reads back with gguf-py;
* the values handed to ``llama_model_quantize`` are llama-quantize's (``in_sum2 / counts``): the preset made from
  the matrix read back from the file is byte-identical to the one made in-process, differs from the plain preset,
  and an i-quant preset that needs a matrix (IQ2_XXS) is made;
* a size run's anchor is that preset made with the run's own matrix (``model.imatrix`` in the output), named so in
  the report, the summary and the card; a smaller preset that is better on the gate's text is named beside it
  and is what the gate's "at least as good as the preset" compares with.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from test_gguf import (  # noqa: F401  (tokenizer, ids: fixtures)
    TEXT, _request, _size_recipe, _worse, gread, gw, ids, needs_llama_cpp, tiny, tokenizer,
)

gguf = pytest.importorskip("gguf")

#: Rows of 256: llama.cpp's K- and i-quants take them without falling back to 32-block types.
WIDE = {"hidden_size": 256, "intermediate_size": 512}


def _priced(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [SimpleNamespace(name=n, imatrix=(rng.random(s) + 1e-3).astype(np.float32)) for n, s in shapes.items()]


def test_the_importance_matrix_is_llama_cpps_imatrix_gguf_and_reads_back(tmp_path):
    from compressor.output.gguf.imatrix import ImportanceMatrix

    priced = _priced({"blk.0.attn_q.weight": (256,), "blk.0.ffn_up_exps.weight": (4, 64)})
    m = ImportanceMatrix.of(priced, tokens=2048, chunk_size=512, datasets=["wiki.train.raw"])
    m.write(tmp_path / "m.imatrix")
    r = gguf.GGUFReader(str(tmp_path / "m.imatrix"))
    assert r.get_field("general.type").contents() == "imatrix" and r.get_field("general.architecture") is None
    assert r.get_field("imatrix.datasets").contents() == ["wiki.train.raw"]
    assert r.get_field("imatrix.chunk_count").contents() == 4 and r.get_field("imatrix.chunk_size").contents() == 512
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {f"{n}.{k}" for n in ("blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight")
                            for k in ("in_sum2", "counts")}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    # ggml's ne order: [n_cols, n_mat] sums, [1, n_mat] counts (llama-imatrix's shapes)
    assert [int(d) for d in tensors["blk.0.ffn_up_exps.weight.in_sum2"].shape] == [64, 4]
    assert [int(d) for d in tensors["blk.0.ffn_up_exps.weight.counts"].shape] == [1, 4]
    assert np.all(np.array(tensors["blk.0.attn_q.weight.counts"].data) == 2048)
    back = ImportanceMatrix.read(tmp_path / "m.imatrix")
    assert back.datasets == ["wiki.train.raw"] and (back.chunk_count, back.chunk_size) == (4, 512)
    for name, v in m.values().items():
        assert np.array_equal(back.values()[name], v)  # what llama-quantize hands ggml, to the bit
    for p in priced:  # in_sum2 / counts is the run's importance, per expert
        np.testing.assert_allclose(m.values()[p.name], p.imatrix.reshape(-1), rtol=1e-6)
    with pytest.raises(ValueError, match="not an imatrix GGUF"):
        ImportanceMatrix.read(_plain_gguf(tmp_path))


def _plain_gguf(tmp_path: Path) -> Path:
    w = gguf.GGUFWriter(str(tmp_path / "plain.gguf"), arch="llama")
    w.add_tensor("x", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "plain.gguf"


def _f16(tmp_path: Path, tokenizer, ids) -> Path:
    gw.GGUFWriter().write(_request(tiny("llama", **WIDE), tokenizer, ids, quant="f16", expected=1.0,
                                   file="f16.gguf"), tmp_path)
    return tmp_path / "f16.gguf"


def _data(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def test_a_preset_made_with_the_matrix_is_llama_quantizes_and_not_the_plain_one(tmp_path, tokenizer, ids):
    needs_llama_cpp()
    from compressor.output.gguf.budget import quantized_shapes
    from compressor.output.gguf.encode import PRESETS, quantize_file
    from compressor.output.gguf.imatrix import ImportanceMatrix

    f16 = _f16(tmp_path, tokenizer, ids)
    shapes = quantized_shapes(f16)
    matrix = ImportanceMatrix.of(_priced({n: (s[0],) for n, s in shapes.items()}), 4096, 64, ["cal.txt"])
    matrix.write(tmp_path / "model.imatrix")
    quantize_file(f16, tmp_path / "plain.gguf", PRESETS["Q4_K_M"])
    quantize_file(f16, tmp_path / "run.gguf", PRESETS["Q4_K_M"], imatrix=matrix)
    # llama-quantize --imatrix model.imatrix: the values its loader reads off the file, handed over the same way
    quantize_file(f16, tmp_path / "file.gguf", PRESETS["Q4_K_M"],
                  imatrix=ImportanceMatrix.read(tmp_path / "model.imatrix"))
    assert (tmp_path / "run.gguf").read_bytes() == (tmp_path / "file.gguf").read_bytes()
    plain, run = _data(tmp_path / "plain.gguf"), _data(tmp_path / "run.gguf")
    assert {n: t for n, (t, _) in plain.items()} == {n: t for n, (t, _) in run.items()}  # Q4_K_M's type mix
    weighted = [n for n in shapes if plain[n][0] != "F16"]
    assert weighted and all(plain[n][1] != run[n][1] for n in weighted)  # every quantized tensor's codes differ
    fields = gguf.GGUFReader(str(tmp_path / "run.gguf")).fields
    assert fields["quantize.imatrix.file"].contents() == "model.imatrix"
    assert fields["quantize.imatrix.entries_count"].contents() == len(shapes)
    assert fields["quantize.imatrix.dataset"].contents() == "cal.txt"
    with pytest.raises(RuntimeError, match="quantizer failed"):  # llama.cpp: "requires an importance matrix"
        quantize_file(f16, tmp_path / "iq.gguf", PRESETS["IQ2_XXS"])
    quantize_file(f16, tmp_path / "iq.gguf", PRESETS["IQ2_XXS"], imatrix=matrix)
    assert "IQ2_XXS" in {t for t, _ in _data(tmp_path / "iq.gguf").values()}


def _wide_source(tmp_path: Path, tokenizer, ids) -> Path:
    """A 256-wide tiny llama GGUF (``src/tiny.gguf``) and the calibration and evaluation texts beside it."""
    src = tmp_path / "src"
    src.mkdir()
    gw.GGUFWriter().write(_request(tiny("llama", **WIDE), tokenizer, ids, quant="f16", expected=1.0,
                                   file="tiny.gguf"), src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(600)) + "\n")
    return src / "tiny.gguf"


def test_a_size_run_measures_beside_the_imatrix_preset_and_the_best_of_no_more_bytes(tmp_path, tokenizer, ids,
                                                                                     monkeypatch, capsys):
    """At Q3_K_M's size the anchor is llama.cpp's Q3_K_M made with the run's own matrix (in the output as
    ``model.imatrix``); the next presets below it are measured too. With the scores arranged so that IQ3_M is
    better than Q3_K_M, and the file over the default budget but better than IQ3_M, the report names IQ3_M beside
    Q3_K_M and the gate passes the file as at least as good as IQ3_M."""
    needs_llama_cpp()
    import compressor
    from compressor.cli.run import _print_summary
    from compressor.output.gguf.imatrix import ImportanceMatrix
    from compressor.reports.card import model_card

    real = gread.read_scores
    worse = {"model.gguf": math.log(1.5), "Q3_K_M.gguf": math.log(4.0), "rival-IQ3_M.gguf": math.log(2.0)}
    monkeypatch.setattr("compressor.output.gguf.read.read_scores",
                        lambda path, *a: _worse(real(path, *a), worse.get(path.name, math.log(8.0))))
    src = _wide_source(tmp_path, tokenizer, ids)
    res = compressor.run(_size_recipe(tmp_path, src, "out", "Q3_K_M", {}))
    assert res.exit_code == 0, res.report.get("message")
    check = res.report["verification"]["gguf"]
    preset = res.report["size_plan"]["preset"]
    assert preset["name"] == "Q3_K_M" and "importance matrix" in preset["made_by"]
    assert preset["file_bytes"] == res.report["size_plan"]["budget_bytes"] >= check["file_bytes"]
    assert check["preset"]["called"] == "llama.cpp's Q3_K_M with an importance matrix"
    rivals = {r["name"]: r for r in check["rivals"]}
    assert set(rivals) == {"IQ3_M", "IQ3_S"} and all(r["file_bytes"] <= preset["file_bytes"] for r in rivals.values())
    best = check["best_preset"]
    assert best["name"] == "IQ3_M" and best["called"] == "llama.cpp's IQ3_M with an importance matrix"
    assert check["gate_rule"] == "preset" and all(d["against_preset"]["at_least_as_good"] for d in check["domains"])
    assert all(d["best_preset_relative_change"] < d["preset_relative_change"] for d in check["domains"])
    assert "at least as good as llama.cpp's IQ3_M with an importance matrix" in res.report["message"]
    matrix = ImportanceMatrix.read(res.output / "model.imatrix")
    planned = {r["tensor"] for r in res.report["size_plan"]["tensors"]}
    assert planned <= set(matrix.sums) and matrix.datasets == ["cal.txt"]
    _print_summary(res.report, None)
    out = capsys.readouterr().out
    assert "beside it: llama.cpp's Q3_K_M with an importance matrix from the same F16" in out
    assert "better of no more bytes: llama.cpp's IQ3_M with an importance matrix" in out
    card = model_card(res.report)
    assert "with an importance matrix" in card and "model.imatrix" in card and "IQ3_M" in card
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no work folder left


def test_smallest_searches_below_its_first_passing_plan(tmp_path, tokenizer, ids):
    """``output.size: smallest`` (issue 71, minor 5): the first plan (predicted at a share of the budget) passes
    a loose budget, and the search goes on below it: the file written is the smallest that passed, smaller than
    the first."""
    needs_llama_cpp()
    import compressor

    src = _wide_source(tmp_path, tokenizer, ids)  # rows wide enough that the search has bytes to bisect
    res = compressor.run(_size_recipe(tmp_path, src, "out", "smallest", {"ppl_budget": 0.3, "max_backoff": 3}))
    assert res.exit_code == 0, res.report.get("message")
    attempts = res.report["size_plan"]["search"]["attempts"]
    assert attempts[0]["passed"] and len(attempts) > 1
    written = res.report["verification"]["gguf"]["file_bytes"]
    assert written == min(a["file_bytes"] for a in attempts if a["passed"]) < attempts[0]["file_bytes"]
    assert (res.output / "model.gguf").stat().st_size == written
