"""The ``hf`` writer: a normal Hugging Face folder that reloads with ``from_pretrained``.

The folder holds safetensors weights (the replaced FFN weights are gone), the
tokenizer, ``config.json`` with a versioned ``compression`` section and an
``auto_map`` pointing at ``modeling_compressor.py`` (a verbatim copy of
:mod:`compressor.core.modeling` plus a footer naming the base classes), the
recipe, the report and a model card. It is built in a temporary folder beside
the output and renamed into place at the end.

Modules: :mod:`.folder` (the ``hf`` writer and what the other folder writers share: casting, the reference
logits, the reload check, ``load_compressed``) and :mod:`.standard` (``hf-standard``).
"""

from compressor.output.hf.folder import (
    MODELING_FILE, OFFLOAD_SHARD_SIZE, OUTPUT_DTYPES, HFWriter, adopt_compressed, base_class_names,
    cast_state_dict, compare_reloaded, computes_on_gpu, finish_folder, folder_weight_bytes, load_compressed,
    logit_tolerance, modeling_source, output_dtype, reference_logits, register_auto_classes, rounded_copy,
    source_weight_bytes,
)
from compressor.output.hf.standard import StandardWriter
from compressor.output.registry import Format, register_format

__all__ = [
    "HFWriter", "MODELING_FILE", "OFFLOAD_SHARD_SIZE", "OUTPUT_DTYPES", "StandardWriter", "adopt_compressed",
    "base_class_names", "cast_state_dict", "compare_reloaded", "computes_on_gpu", "finish_folder",
    "folder_weight_bytes", "load_compressed", "logit_tolerance", "modeling_source", "output_dtype",
    "reference_logits", "register_auto_classes", "rounded_copy", "source_weight_bytes",
]

register_format(Format("hf", HFWriter, folder=True))
register_format(Format("hf-standard", StandardWriter, folder=True))
