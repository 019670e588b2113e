"""Speed benchmarks: compressed outputs against their source in transformers and in llama.cpp."""
