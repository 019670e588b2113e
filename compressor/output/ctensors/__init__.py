"""The ``compressed-tensors`` format: integer weights as llm-compressor writes them and vLLM serves them.

The folder is what llm-compressor's ``oneshot`` with a GPTQ W4A16 recipe and ``save_pretrained`` give: the base
model's own class, every quantized ``nn.Linear`` stored ``pack-quantized``, ``quantization_config`` in
``config.json``; ``AutoModelForCausalLM.from_pretrained(folder)`` loads it wherever the ``compressed-tensors``
package is installed. The packing and config are the library's own; this package hands it the scales and the
rounded weights (GPTQ where a layer's Ĥ is given, else nearest). Layers, schemes and the output head:
docs/compressed-tensors.md.

Modules: :mod:`.writer` (the writer and its reload check), :mod:`.stream` (an onloaded model's, one tensor at a
time), :mod:`.schemes` (which layer gets which scheme, the config), :mod:`.rounding` (rounding and the library's
packing), :mod:`.grids` (the integer grids, GPTQ), :mod:`.target` (the size target).
"""

from compressor.output.ctensors.target import CompressedTensorsTarget
from compressor.output.ctensors.writer import CompressedTensorsWriter
from compressor.output.registry import Format, register_format

__all__ = ["CompressedTensorsTarget", "CompressedTensorsWriter"]

register_format(Format("compressed-tensors", CompressedTensorsWriter, CompressedTensorsTarget, folder=True))
