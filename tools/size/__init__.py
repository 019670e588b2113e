"""Size planner benchmarks: GGUF and compressed-tensors files at a byte budget against llama.cpp, AutoRound and
llm-compressor, and the planner's pieces (its cost model, rounding, statistics)."""
