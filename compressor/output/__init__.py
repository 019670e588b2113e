"""The write stage: output writers, one registered class per format.

``hf`` (:mod:`.hf`) is a Hugging Face folder. A new format is a new module
here with an ``@register_writer`` class (see :mod:`.base`), imported below.
"""

from compressor.output import ctensors  # noqa: F401  (registers the compressed-tensors writer)
from compressor.output import gguf  # noqa: F401  (registers the gguf writer)
from compressor.output import hf  # noqa: F401  (registers the hf writer)
from compressor.output import standard  # noqa: F401  (registers the hf-standard writer)
from compressor.output.base import (
    WRITERS, VerificationError, WriteRequest, Writer, get_writer, publish, register_writer, staging_folder,
)

__all__ = ["WRITERS", "VerificationError", "WriteRequest", "Writer", "get_writer", "publish", "register_writer",
           "staging_folder"]
