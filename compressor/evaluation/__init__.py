"""The validate stage's measurements: perplexity with a standard error, KL to the original, the gate check."""
