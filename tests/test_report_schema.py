"""report.json's schema (:class:`compressor.reports.schema.Report`): versioned, checked, and speaking for itself.

The schema file in docs/ is the model's; a report with a key missing or of the wrong type is refused naming the
key; the summary and the model card of a size-planned file speak in the words of its format's size target, and
no module of the CLI or the reports names a format to word it. Real runs' reports are validated where the tests
that make them run (a structural run: ``test_cli.py``; a GGUF size run: ``test_gguf.py``; a compressed-tensors
size run: ``test_ctensors_size.py``), and by every run as it publishes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minimal_report import minimal_report

from compressor.output.registry import formats, targets
from compressor.reports.schema import SCHEMA_FILE, SCHEMA_VERSION, Report
from compressor.reports.wording import CardWords

ROOT = Path(__file__).resolve().parents[1]


def test_the_schema_file_is_current():
    """docs/report.schema.json is what the model says; regenerate it with
    ``python -c "from compressor.reports.schema import *; open(SCHEMA_FILE, 'w').write(Report.json_schema_text())"``."""
    assert (ROOT / SCHEMA_FILE).read_text(encoding="utf-8") == Report.json_schema_text()
    schema = Report.model_json_schema()
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert {"schema_version", "schema", "status", "perplexity", "evaluation", "size"} <= set(schema["required"])


def test_a_report_with_a_key_missing_or_mistyped_is_refused_naming_it():
    Report.of(minimal_report())
    broken = minimal_report()
    del broken["evaluation"]["confidence"]
    with pytest.raises(ValueError, match=r"evaluation\.confidence\s+Field required"):
        Report.of(broken)
    with pytest.raises(ValueError, match="schema_version"):
        Report.of(minimal_report(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(ValueError, match=r"params\.after"):
        Report.of(minimal_report(params={"after": "many"}))
    later = Report.of(minimal_report(a_later_key={"kept": True}))  # a key added later keeps the version
    assert later.model_extra == {"a_later_key": {"kept": True}}


def _planned(fmt: str, size: str, types: dict) -> dict:
    return minimal_report(
        strategy="size", recipe={"output": {"formats": [fmt]}},
        size_plan={"size": size, "budget_bytes": 1000, "types_used": types, "predicted_ppl_change": 0.01},
        verification={fmt: {
            "quant": "plan", "planned_format": fmt, "file_bytes": 900, "planned_file_bytes": 900, "budget_bytes": 1000,
            "predicted_relative_change": 0.01, "confidence": 0.9,
            "preset": {"name": size, "file_bytes": 1000, "called": targets()[fmt]().anchor_called(size)},
            "domains": [{"name": "prose", "perplexity": 10.2, "relative_change": 0.02, "confidence": 0.9,
                         "relative_delta_upper": 0.03, "reference_perplexity": 10.0, "kl_mean": 0.01, "kl_p99": 0.1,
                         "same_top_token": 0.95, "preset_relative_change": 0.08, "preset_kl_mean": 0.02}]}})


def test_a_planned_compressed_tensors_file_is_summarized_in_its_formats_words():
    formats()
    report = Report.of(_planned("compressed-tensors", "W4A16", {"W8A16": 2, "W4A16": 5}))
    out = "\n".join(report.summary_lines(Path("out")))
    assert "compressed-tensors: 900 B (budget 1.0 KB, output.size W4A16); layer schemes: W4A16 ×5, W8A16 ×2" in out
    assert "beside it: the uniform W4A16 checkpoint, 1.0 KB" in out
    assert "transformers [prose]: perplexity 10.2000, +2.00 % (90% bound +3.00 %)" in out and "W4A16: +8.00 %" in out
    assert out.endswith("model:  out\nreport: out/report.json")
    card = report.card()
    assert "library_name: transformers" in card and "Layer schemes: W4A16 ×5, W8A16 ×2." in card
    assert "| uniform W4A16 | its KL |" in card and "vllm serve" in card


def test_a_planned_gguf_names_its_file_and_the_preset_from_the_same_f16():
    formats()
    report = Report.of(_planned("gguf", "Q4_K_M", {"Q4_K": 3, "Q6_K": 1}))
    out = report.summary_lines(Path("out"))
    assert "beside it: llama.cpp's Q4_K_M with an importance matrix from the same F16, 1.0 KB" in out[2]
    assert out[3].startswith("llama.cpp [prose]:") and out[-2] == "model:  out/model.gguf"
    card = report.card()
    assert "library_name: gguf" in card and "Tensor types: Q4_K ×3, Q6_K ×1." in card and "llama-cli" in card


def test_every_size_target_words_its_file_for_the_card():
    for fmt, target in targets().items():
        words = target()
        CardWords(**words.card_words())  # every phrase named, no other
        assert words.runs_in and words.choices, fmt


def test_no_cli_or_report_module_names_a_format_to_word_it():
    """Wording that depends on the format is the format's size target's (``card_words``, ``beside``, …); the CLI
    and the reports name a format only where the user chooses one (``export --format``)."""
    names = [f for f in formats() if targets().get(f) is not None]
    found = []
    for path in [*(ROOT / "compressor" / "cli").glob("*.py"), *(ROOT / "compressor" / "reports").glob("*.py")]:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(re.search(rf"""["']{re.escape(n)}["']""", line) for n in names) and "--format" not in line \
                    and "getLogger" not in line:  # the gguf-py library's logger, not the format
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "format names outside their packages:\n" + "\n".join(found)
