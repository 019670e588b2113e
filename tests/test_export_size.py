"""``compressor export`` on an output folder whose GGUF ``compressor run`` planned to a size (``output.size``).

The folders are written by hand (a report.json that says so, a few bytes standing for the files): the
refusals come before any model or tokenizer loads, so nothing real is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compressor.cli import main

PLANNED = b"GGUF planned to 5.2 MB"


@pytest.fixture
def no_loading(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("compressor.output.hf.load_compressed", boom)


def _size_folder(folder: Path, *, hf: bool) -> Path:
    folder.mkdir()
    (folder / "model.gguf").write_bytes(PLANNED)
    report = {"status": "ok", "size_plan": {"size": "Q4_K_M", "budget_bytes": 5_200_000},
              "verification": {"gguf": {"quant": "plan", "file_bytes": len(PLANNED)}}}
    (folder / "report.json").write_text(json.dumps(report))
    if hf:
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "llama", "compression": {"format": "compressor/v1", "blocks": [],
                                                    "source_model": "/nonexistent/tiny.gguf"}}))
        (folder / "model.safetensors").write_bytes(b"weights")
    return folder


@pytest.mark.parametrize("overwrite", [True, False])
def test_export_refuses_to_replace_a_gguf_planned_to_a_size(tmp_path, capsys, no_loading, overwrite):
    folder = _size_folder(tmp_path / "out", hf=True)
    assert main(["export", str(folder)] + (["--overwrite"] if overwrite else [])) == 2
    err = capsys.readouterr().err
    assert "planned to a size" in err and "compressor run" in err and "different file" in err
    assert "--output" in err and "another folder" in err  # the fix
    assert (folder / "model.gguf").read_bytes() == PLANNED  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind


def test_export_of_a_size_folder_to_another_folder_is_not_refused_for_the_plan(tmp_path, capsys, no_loading):
    folder = _size_folder(tmp_path / "out", hf=True)
    (tmp_path / "elsewhere").mkdir()
    main(["export", str(folder), "--output", str(tmp_path / "elsewhere" / "model.gguf")])
    assert "planned to a size" not in capsys.readouterr().err
    assert (folder / "model.gguf").read_bytes() == PLANNED


def test_export_of_a_gguf_only_size_folder_says_there_are_no_weights_to_export(tmp_path, capsys, no_loading):
    folder = _size_folder(tmp_path / "out", hf=False)
    assert main(["export", str(folder), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not a compressor output folder" not in err
    assert "size-planned GGUF" in err and "no Hugging Face weights" in err and "nothing to export" in err
    assert sorted(p.name for p in folder.iterdir()) == ["model.gguf", "report.json"]
