"""The validate stage's measurements: perplexity with a standard error (perplexity), KL to the original
(teacher), scores measured elsewhere (external: llama.cpp, a reloaded checkpoint), the gate check (gate); each
name is imported from the module that defines it."""
