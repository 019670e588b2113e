"""The ``compressed-tensors`` writer: integer weights in the format llm-compressor writes and vLLM serves.

The folder is what ``oneshot(model, recipe=GPTQModifier(scheme="W4A16", targets="Linear",
ignore=["lm_head"]))`` followed by ``save_pretrained`` gives: the base model's own class, every
quantized ``nn.Linear`` stored ``pack-quantized`` (codes packed into int32 ``weight_packed``, a
``weight_scale`` per group in the saved dtype, ``weight_shape``), every other tensor in the saved dtype,
and ``quantization_config`` in ``config.json``. ``AutoModelForCausalLM.from_pretrained(folder)`` loads it
with no flag wherever the ``compressed-tensors`` package is installed; vLLM serves it as it is.

What each layer gets (``request.options``):

* ``ct_schemes``: module name → scheme name (:data:`~compressor.output.ctensors.grids.SCHEMES`) or None
  (left in the float dtype); a layer not named is left in the float dtype. Else
* ``ct_scheme`` (default ``W4A16``) for every ``nn.Linear`` but the output head; embeddings never.

An output head with a weight of its own (not tied to the input embedding) may be given a scheme in ``ct_schemes``
(a size plan does so, ``output.ct_head: plan``): vLLM reads a quantized ``lm_head`` since its PR #37291; the uniform
``ct_scheme`` leaves it in the float dtype, as llm-compressor's ``ignore=["lm_head"]`` does.
* ``ct_hessians``: module name → that layer's input second moment Ĥ ``[in, in]``: the layer is rounded by
  GPTQ (:func:`~compressor.output.ctensors.grids.gptq`), a layer without one to nearest.

The packing, the config groups and ``quantization_config`` are the library's own
(``apply_quantization_config``, ``ModelCompressor.compress_model`` and ``update_config``, the calls
llm-compressor's save wrapper makes); this module only hands it the scales and the rounded weights, whose
codes the compressor recovers exactly. The model in memory is left as it was: the writer works on a copy
that shares every tensor it does not replace.

A pruned model (``replacement.kind: prune``) is saved as its base class at the pruned width first, as
``hf-standard`` does (:func:`compressor.output.hf.standard.standard_model`); other kinds have no place in a
plain transformers class and are refused.

An onloaded model (``model.offload: disk``) is written and checked one tensor at a time instead
(:mod:`.stream`): the library's per-layer packer, safetensors shards, and a reload check that compares every
tensor exactly; the same folder as the in-memory path.

Modules: :mod:`.writer` (the writer and its reload check), :mod:`.stream` (an onloaded model's),
:mod:`.schemes` (which layer gets which scheme, the config), :mod:`.rounding` (rounding and the library's
packing), :mod:`.grids` (the integer grids, GPTQ), :mod:`.target` (the size target).

Verification reloads the folder with plain ``AutoModelForCausalLM.from_pretrained`` (the library
decompresses it) and compares its logits with the in-memory model whose quantized weights are replaced by
the values the file decodes to, to float tolerance (onloaded: every tensor, exactly); the reloaded model's
perplexity on the probe is recorded with the change quantizing made (judged, if at all, by the stage that
chose the schemes).
"""

from compressor.output.ctensors.grids import IntScheme, Rounded
from compressor.output.ctensors.rounding import base_model, round_layers
from compressor.output.ctensors.schemes import (
    CTENSORS_FORMAT, DEFAULT_SCHEME, FUSED_SIBLINGS, GPTQ_ORDER, INSTALL, JOIN, PACK_FORMAT, SchemePlan,
    fused_units, head_name, head_scheme, layer_schemes, library_missing, linear_bytes, linear_names,
    quantization_config, scheme_counts, tensor_bytes, unit_members,
)
from compressor.output.ctensors.target import CompressedTensorsTarget
from compressor.output.ctensors.writer import CompressedTensorsWriter, score_folder
from compressor.output.registry import Format, register_format

__all__ = [
    "CTENSORS_FORMAT", "DEFAULT_SCHEME", "FUSED_SIBLINGS", "GPTQ_ORDER", "INSTALL", "JOIN", "PACK_FORMAT",
    "CompressedTensorsWriter", "IntScheme", "Rounded", "SchemePlan", "base_model", "fused_units", "head_name",
    "head_scheme", "layer_schemes", "library_missing", "linear_bytes", "linear_names", "quantization_config",
    "round_layers", "scheme_counts", "score_folder", "tensor_bytes", "unit_members",
]

register_format(Format("compressed-tensors", CompressedTensorsWriter, CompressedTensorsTarget))
