"""The layer-sequential engine: one decoder layer at a time, statistics streamed, never activations.

walker (the walk), measure (per-block statistics), profiling (R²_lin and
friends per block), sensitivity (loss-gradient moments), resume (checkpoints
of finished steps: runkey, records, runstate), spill (fit inputs kept on disk),
memory (the memory model), cache (the statistics cache).
"""
