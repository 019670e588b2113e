"""Checks: the independent ones (``independent_check.py``, ``llamacpp_perplexity.py``) score outputs without
compressor; ``gpu_check.py`` holds compressor on a GPU to the same run on the CPU."""
