"""Every row of the architecture table is complete and consistent, and true of a tiny model of its type.

:data:`compressor.core.archs.ARCHITECTURES` is the one place per-model-type facts live (where the FFN
is, its width attribute, its pre-FFN norm, how the gguf writer writes it): a new architecture is a row
there and a tiny model in ``tests/tiny.py``; this file then checks the row against that model.
"""

from __future__ import annotations

import pytest
from tiny import ARCH_MATRIX, MOE_TYPES, tiny_model

from compressor.core.archs import ARCHITECTURES, TEXT_MODEL_OF, ArchSpec, UnsupportedModelError, arch_for, find_blocks
from compressor.output.gguf.naming import ROPE_LAYOUT

ROWS = sorted(ARCHITECTURES)


def test_every_row_has_a_tiny_model_and_its_own_spec():
    assert set(ARCHITECTURES) == set(ARCH_MATRIX) | set(MOE_TYPES)
    assert {t for t, s in ARCHITECTURES.items() if s.moe} == set(MOE_TYPES)
    assert len({id(spec) for spec in ARCHITECTURES.values()}) == len(ARCHITECTURES)  # no row shares another's


def test_pre_ffn_norm_must_be_stated():
    with pytest.raises(TypeError, match="pre_ffn_norm"):
        ArchSpec(blocks=("model.layers",))
    assert ArchSpec(blocks=("model.layers",), pre_ffn_norm=None).pre_ffn_norm is None


@pytest.mark.parametrize("model_type", ROWS)
def test_row_is_complete(model_type):
    spec = ARCHITECTURES[model_type]
    assert spec.blocks and all(spec.blocks)
    assert spec.ffn_in and spec.ffn_out and spec.width_attr and spec.act_attrs
    if spec.compressible:
        assert spec.ffn_in == spec.ffn_out, "a compressible FFN is one module"
        # no ffn_up: hidden-unit kinds are not offered (Phi-3's fused gate_up_proj), and the row says so
        assert (spec.ffn_up and all(spec.ffn_up) and spec.ffn_down) or (not spec.ffn_up and spec.note)
    assert spec.pre_ffn_norm is None or spec.pre_ffn_norm.strip()
    if spec.compressible:
        assert spec.pre_ffn_norm is not None, "only post-norm encoders have no pre-FFN norm"


@pytest.mark.parametrize("model_type", ROWS)
def test_gguf_facts_are_consistent(model_type):
    spec = ARCHITECTURES[model_type]
    if spec.gguf_native is None:
        assert spec.gguf_refusal.strip(), "a type the gguf writer refuses says why"
        assert spec.gguf_per_layer is None and not spec.gguf_native_ffn_bias
    else:
        assert spec.compressible and spec.gguf_arch and spec.gguf_per_layer
        assert spec.gguf_native in ROPE_LAYOUT and spec.gguf_per_layer in ROPE_LAYOUT
    if spec.gguf_arch is not None:
        gguf = pytest.importorskip("gguf")
        assert spec.gguf_arch in gguf.MODEL_ARCH.__members__


def test_text_model_wrappers_point_at_rows_with_gguf_names():
    for wrapper, text in TEXT_MODEL_OF.items():
        assert wrapper not in ARCHITECTURES and text in ARCHITECTURES
        assert ARCHITECTURES[text].gguf_arch


def test_derived_tables_follow_the_rows():
    from compressor.analysis.crossfeed import PRE_FFN_NORM
    from compressor.output.gguf.naming import REQUANTIZE_ARCH
    from compressor.output.gguf.plan import arch_refusal

    assert PRE_FFN_NORM == {t: s.pre_ffn_norm for t, s in ARCHITECTURES.items()}
    assert REQUANTIZE_ARCH == {**{t: s.gguf_arch for t, s in ARCHITECTURES.items() if s.gguf_arch},
                               **{w: ARCHITECTURES[t].gguf_arch for w, t in TEXT_MODEL_OF.items()}}
    for t, spec in ARCHITECTURES.items():
        why = arch_refusal(t)
        assert (why is None) == (spec.gguf_native is not None)
        assert why is None or spec.gguf_refusal in why


@pytest.mark.parametrize("model_type", ROWS)
def test_row_is_true_of_a_tiny_model(model_type):
    model = tiny_model(model_type)
    spec = ARCHITECTURES[model_type]
    if spec.moe:  # a mixture of experts: size plans only; what measures or replaces blocks refuses it
        with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
            arch_for(model)
    assert arch_for(model, structural=spec.moe is False) == (model_type, spec)
    _, blocks = find_blocks(model, spec)
    block = blocks[0]
    block.get_submodule(spec.ffn_in)
    ffn = block.get_submodule(spec.ffn_out)
    if spec.pre_ffn_norm is not None:
        block.get_submodule(spec.pre_ffn_norm)
    assert any(getattr(model.config, a, None) for a in spec.act_attrs)
    if spec.ffn_down:
        for name in spec.ffn_up:
            ffn.get_submodule(name)
        down = ffn.get_submodule(spec.ffn_down)
        width = down.weight.shape[0] if type(down).__name__ == "Conv1D" else down.weight.shape[1]
        assert getattr(model.config, spec.width_attr) == width


@pytest.mark.parametrize("model_type", [t for t in ROWS if ARCHITECTURES[t].gguf_arch])
def test_gguf_arch_names_every_weight(model_type):
    gguf = pytest.importorskip("gguf")
    model = tiny_model(model_type)
    spec = ARCHITECTURES[model_type]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf_arch), model.config.num_hidden_layers)
    missing = [n for n in model.state_dict() if names.get_name(n, try_suffixes=(".weight", ".bias")) is None]
    assert not missing


def test_the_unsupported_error_names_the_table():
    model = tiny_model("llama")
    model.config.model_type = "not_a_model"
    with pytest.raises(UnsupportedModelError, match=r"ARCHITECTURES in compressor/core/archs\.py"):
        arch_for(model)
