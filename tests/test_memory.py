"""The memory model's parts against the objects a run actually builds, on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
import transformers

from compressor.engine.walker import LayerWalker
from compressor.engine.memory import LLAMA_SHAPES, estimate, layer_params
from compressor.fitting.replace import count_params

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SHAPE = dict(d=32, d_ff=80, layers=3, vocab=128, heads=4, kv_heads=2, tied=False)


def _model() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab"], hidden_size=SHAPE["d"], intermediate_size=SHAPE["d_ff"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"], tie_word_embeddings=SHAPE["tied"])
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict("m").values() if t.dtype == torch.float64)


def test_weights_match_the_model():
    model = _model()
    est = estimate(**SHAPE, tokens=256, kind="profile")
    assert layer_params(SHAPE["d"], SHAPE["d_ff"], SHAPE["heads"], SHAPE["kv_heads"]) == count_params(model.model.layers[0])
    assert est.all_weights == count_params(model) * 4
    assert est.resident_weights == (count_params(model) - 3 * count_params(model.model.layers[0])) * 4


@pytest.mark.parametrize("kind", ["profile", "hybrid"])
def test_statistics_and_activations_match_a_walk(kind):
    model = _model()
    windows = torch.randint(3, 120, (8, 32), generator=torch.Generator().manual_seed(0))
    walker = LayerWalker(model, {"fit": windows[:6], "heldout": windows[6:]}, batch_size=4)
    tokens = windows.numel()
    est = estimate(**SHAPE, tokens=tokens, kind=kind)
    cached = sum(h.numel() * h.element_size() for h in walker.inputs)
    assert est.activation_caches == 2 * cached  # a layer's inputs and outputs
    seen = []

    def on_layer(i, st):
        stats = _bytes(st.xy.fit) + sum(_bytes(m) for m in st.xy.heldout.values())
        if kind == "hybrid":
            stats += _bytes(st.zfit) + _bytes(st.zheld)
        seen.append(stats)

    walker.walk(on_layer, hidden=kind == "hybrid")
    # the model counts the matrices; the vectors (means, diagonals) are a rounding error at real sizes
    for s in seen:
        assert est.layer_statistics <= s <= 1.1 * est.layer_statistics


def test_published_shapes_are_consistent():
    for name, shape in LLAMA_SHAPES.items():
        e = estimate(**shape, tokens=131072, kind="hybrid")
        assert e.onloaded_peak < e.in_memory_peak, name
        assert e.solve_workspace > 0 and e.layer_statistics > 0
