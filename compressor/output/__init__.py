"""The write stage: one package per output format, behind one registry (:mod:`.registry`).

:mod:`.gguf` (llama.cpp), :mod:`.ctensors` (compressed-tensors for vLLM), :mod:`.hf` (a Hugging Face folder,
``hf`` and ``hf-standard``); :mod:`.base` is what every writer provides and the atomic publishing. A new
format is a new package here registering one :class:`~.registry.Format`, imported below.
"""

from compressor.output import ctensors  # noqa: F401  (registers compressed-tensors)
from compressor.output import gguf  # noqa: F401  (registers gguf)
from compressor.output import hf  # noqa: F401  (registers hf and hf-standard)
from compressor.output.base import VerificationError, WriteRequest, Writer, Written, publish, staging_folder
from compressor.output.registry import FORMATS, Format, get_writer, register_format

__all__ = ["FORMATS", "Format", "VerificationError", "WriteRequest", "Writer", "Written", "get_writer", "publish",
           "register_format", "staging_folder"]
