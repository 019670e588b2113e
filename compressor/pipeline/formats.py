"""The recipe's output formats as the writers see them: their options (:func:`writer_options`) and their
refusals of a run, asked before the model loads (:func:`writer_refusals`)."""

from __future__ import annotations

from compressor.core.errors import InputError
from compressor.inputs.load import ResolvedSource
from compressor.output import get_writer
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import OutputConfig, Recipe


def writer_refusals(recipe: Recipe, kind: str, tokenizer, model_type: str, src: ResolvedSource) -> dict:
    """Each requested writer's refusal of a ``kind`` run of ``model_type`` (its architecture, its options, the
    tokenizer), or None, by format name."""
    oc = recipe.output
    options = writer_options(oc)
    out = {}
    for name in oc.writers():
        writer = get_writer(name)
        out[name] = (writer.unsupported(model_type, kind) or writer.check_options(options)
                     or writer.check_tokenizer(tokenizer, src))
    return out


def refuse_writer(oc: OutputConfig, name: str, why: str | None) -> None:
    """A writer's refusal as the error the run stops with (exit 2), saying why a format the recipe did not name
    is there; nothing when ``why`` is None."""
    if why:
        raise InputError(f"output.formats: {name}: {why}{_defaulted_because(oc, name)}")


def _defaulted_because(oc: OutputConfig, name: str) -> str:
    """Why a format the recipe did not name is in ``output.formats``, and how to leave it out."""
    if not oc._defaulted:
        return ""
    if oc.size is not None:
        return f" ({name} is the format output.size {oc.size} plans; name another in output.formats, or another size)"
    return (f" ({name} is in output.formats by default for a GGUF source; set output.formats: [hf] to write only the "
            "Hugging Face folder)")


def writer_options(oc: OutputConfig, result: CompressionResult | None = None) -> dict:
    """The recipe's format-specific output fields, as the writers read them; with ``result``, the bytes of
    the fits snapped onto the GGUF's grid (``stored``: GGUF tensor name → (type name, bytes)), which the
    gguf writer stores as they are."""
    opts = {"quant": oc.gguf_quant, "unquantizable": oc.gguf_unquantizable, "width_multiple": oc.width_multiple}
    stored = {f"blk.{i}.ffn_down.weight": f.stored["out.weight"]
              for i, f in ((result.fitted or {}) if result is not None else {}).items() if "out.weight" in f.stored}
    if stored:
        opts["stored"] = stored
    return opts
