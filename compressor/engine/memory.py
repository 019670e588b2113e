"""The memory model: what a layer-sequential run holds, per layer, on the device and on the host.

With onloading (``model.offload: disk``) the peak is one layer's worth of everything, independent of depth:
the resident modules plus the one decoder layer being run; the hidden states of every calibration window at the
current layer (one stream, or two for teacher targets); one layer's ``x → y`` moments (float64, a fit and three
held-out partitions) and, for hidden-unit kinds, the ``z = [x, h]`` moments; the partial sums the canonical merge
tree keeps alive (:mod:`compressor.core.distributed`); and the solve's workspace (about five (d+f)² float64
matrices for OBS, about 13 d×d for an affine fit and its scoring, measured). On a GPU the weights being run, one
batch, the statistics and the workspace are on the device, the caches on the host. Each term and how it was
measured: docs/large-models.md.

>>> from compressor.engine.memory import estimate, LLAMA_SHAPES                  # doctest: +SKIP
>>> estimate(**LLAMA_SHAPES["llama-2-7b"], tokens=131072, kind="hybrid")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Decoder shapes used in the README's table (public configs).
LLAMA_SHAPES = {
    "smollm2-135m": dict(d=576, d_ff=1536, layers=30, vocab=49152, heads=9, kv_heads=3, tied=True),
    "llama-1b-bench": dict(d=2048, d_ff=5632, layers=22, vocab=49152, heads=32, kv_heads=4, tied=False),
    "llama-2-7b": dict(d=4096, d_ff=11008, layers=32, vocab=32000, heads=32, kv_heads=32, tied=False),
    "llama-3-70b": dict(d=8192, d_ff=28672, layers=80, vocab=128256, heads=64, kv_heads=8, tied=False),
}

#: (d+f)² float64 matrices alive at the peak of a hidden-unit kind's OBS path (see module docstring).
OBS_WORKSPACE_MATRICES = 5
#: d² float64 matrices alive while a block's affine fit is solved and scored on its held-out partitions
#: (every layer: the R²_lin profile); measured 12.5 at d = 2048.
AFFINE_WORKSPACE_MATRICES = 13


@dataclass(frozen=True)
class MemoryEstimate:
    resident_weights: int
    layer_weights: int
    activation_caches: int
    layer_statistics: int
    """The layer's reduced statistics (fit and held-out splits)."""
    accumulation: int
    """Peak of statistics while accumulating: the reduced fit split plus the tree's live partials."""
    solve_workspace: int
    all_weights: int
    """Every weight of the model (what is resident without onloading)."""

    @property
    def statistics_peak(self) -> int:
        return max(self.accumulation, self.layer_statistics + self.solve_workspace)

    @property
    def onloaded_peak(self) -> int:
        return self.resident_weights + self.layer_weights + self.activation_caches + self.statistics_peak

    @property
    def in_memory_peak(self) -> int:
        return self.all_weights + self.activation_caches + self.statistics_peak

    def device_bytes(self, batch_tokens: int, d: int, dtype_bytes: int) -> int:
        """On a GPU: the layer being run, one batch of activations (in and out), statistics, workspace."""
        return (self.resident_weights + self.layer_weights + 2 * batch_tokens * d * dtype_bytes
                + self.statistics_peak)

    def to_json(self) -> dict:
        return {**asdict(self), "statistics_peak": self.statistics_peak, "onloaded_peak": self.onloaded_peak,
                "in_memory_peak": self.in_memory_peak}


def layer_params(d: int, d_ff: int, heads: int, kv_heads: int, gated: bool = True) -> int:
    head_dim = d // heads
    attn = 2 * d * d + 2 * d * kv_heads * head_dim
    ffn = (3 if gated else 2) * d * d_ff
    return attn + ffn + 2 * d  # two RMSNorm weights


def estimate(*, d: int, d_ff: int, layers: int, vocab: int, heads: int, kv_heads: int, tied: bool,
             tokens: int, kind: str = "hybrid", teacher_target: bool = False, dtype_bytes: int = 4,
             gated: bool = True, batches: int | None = None) -> MemoryEstimate:
    """Bytes per component for a Llama-shaped model and ``tokens`` calibration tokens.

    ``kind``: ``profile`` (x → y statistics only), ``affine``/``low_rank``, or
    ``prune``/``hybrid`` (adds the z statistics and the OBS workspace).
    ``batches``: calibration batches in the larger split (default: many).
    """
    from compressor.core.distributed import TREE_DEPTH

    f8 = 8
    resident = (vocab * d * (1 if tied else 2) + d) * dtype_bytes
    layer = layer_params(d, d_ff, heads, kv_heads, gated) * dtype_bytes
    streams = 2 if teacher_target else 1
    acts = 2 * streams * tokens * d * dtype_bytes
    xy = 4 * (2 * d * d) * f8  # fit + 3 held-out partitions, each cxx and cxy (d_out = d)
    # A per-batch partial allocates only the partitions its rows reach: the fit, or up to 3 held-out ones.
    stats, partial = xy, 3 * (2 * d * d) * f8
    work = AFFINE_WORKSPACE_MATRICES * d * d * f8  # every kind profiles the block first
    if kind in ("prune", "hybrid"):
        p = d + d_ff
        stats += 2 * (p * p + p * d) * f8
        partial += (p * p + p * d) * f8  # one split's z moments
        work = max(work, OBS_WORKSPACE_MATRICES * p * p * f8)
    live = TREE_DEPTH + 2 if batches is None else min(TREE_DEPTH + 2, batches + 1)
    accumulation = (1 + live) * partial
    return MemoryEstimate(resident, layer, acts, stats, accumulation, work, resident + layers * layer)


#: Anonymous memory of the process before it loads anything: Python, torch, transformers, compressor and
#: llama.cpp's library imported (measured: 0.28 GB on the 2-core CPU).
PROCESS_BYTES = 350 << 20


#: Anonymous memory of llama.cpp's converter process besides its tensors (Python, torch, its model classes).
CONVERTER_PROCESS_BYTES = 300 * 2**20


def size_components(*, d: int, ff: int, layers: int, vocab: int, tokens: int, fisher_tokens: int = 2048,
                    heads: int | None = None, kv_heads: int | None = None, tied: bool = False, seq_len: int = 512,
                    offload: str = "disk", batch_size: int = 8, reload_check: bool = False,
                    saved_bytes: int = 2) -> dict[str, int]:
    """Host bytes a size plan holds at its peak, by component, for a Llama-shaped model (float32 compute);
    ``reload_check``: the planned file is checked by reloading the whole model in transformers (compressed-tensors)
    rather than made from llama.cpp's converter's F16 (GGUF):

    * ``process``: the interpreter and libraries (:data:`PROCESS_BYTES`);
    * ``resident``: the token embedding and the output head (untied), float32, held between passes — except
      onloaded from disk with an untied head, where both wait on disk with the layers (:mod:`compressor.core.onload`)
      and one of them at a time is read while it runs: ``vocab_pass``, the head's weight (float32) beside F's
      logits, or beside its float32 copy while it is priced and rounded;
    * ``model``: without onloading, every decoder layer's float32 weights; onloaded, one layer's, plus the float32
      copy of that layer's weights that pricing and rounding read;
    * ``hidden_states``: every calibration token's hidden state at the current layer and the next (float32), for
      the layer-sequential Ĥ;
    * ``fisher``: F's backward over micro-batches of :func:`~compressor.engine.sensitivity.backward_rows` windows:
      onloaded, every layer's input for ``fisher_tokens`` (kept for recomputation) and one micro-batch's logits,
      their float copy and gradient (3 · rows · seq_len · vocab floats); in memory, every layer's saved activations
      of the micro-batch (about ``4·ff + 10·d`` floats a token a layer) besides its logits;
    * ``moments``: one layer's input second moments (q/k/v and gate/up share theirs: ``3·d² + ff²`` floats) and
      the working set of the GPTQ factors pricing solves two at a time, Ĥ reordered and its Cholesky factor
      (:func:`~compressor.fitting.gridround.factor`: float32, or float64 where float32 finds Ĥ not positive
      definite; counted at float64, ``16 · (ff² + d²)`` bytes, the bound);
    * ``converter``: llama.cpp's converter making the F16 of a Hugging Face folder, a child process
      (:mod:`compressor.output.gguf.converter`): its interpreter and torch (:data:`CONVERTER_PROCESS_BYTES`) and
      the largest tensor in float32 and float16 (the embedding: measured 1.21 GB on a 3.2B Llama shape with a
      49,152-token vocabulary); a GGUF's only;
    * ``reload``: a compressed-tensors checkpoint reloaded by plain transformers for its check and the gate, the
      library having decompressed every layer: all the weights in the saved dtype (``saved_bytes`` each) — in the
      compute dtype for a model held in memory (its in-memory check), beside the model itself.

    The peak is the largest phase: the F16 made (process + resident + model + converter), the F pass (process +
    resident + model + fisher, + the head's weight when it waits on disk), the Ĥ and pricing pass (process +
    resident + model + hidden states + moments), the head priced and rounded from disk (process + model + twice its
    float32 weight), or a compressed-tensors reload (process + resident + model + reload).
    ``tools/memory/bench_size_memory.py`` measures it against this."""
    from compressor.engine.sensitivity import BACKWARD_BUDGET_BYTES

    heads = heads or max(1, d // 128)
    kv_heads = kv_heads or heads
    f4 = 4
    one_layer = layer_params(d, ff, heads, kv_heads) * f4
    on_disk = offload == "disk" and not tied  # the embedding and head wait on disk (compressor.core.onload)
    resident = 0 if on_disk else vocab * d * f4 * (1 if tied else 2)
    head = vocab * d * f4 if on_disk else 0
    model = 2 * one_layer if offload != "none" else layers * one_layer + one_layer
    hidden = 2 * tokens * d * f4
    per_window = 4 * seq_len * (layers * (4 * ff + 10 * d) + 4 * vocab)
    rows = max(1, min(batch_size, BACKWARD_BUDGET_BYTES // per_window, -(-fisher_tokens // seq_len)))
    logits = 3 * rows * seq_len * vocab * f4
    if offload != "none":
        fisher = (layers + 2) * fisher_tokens * d * f4 + logits
    else:
        fisher = rows * seq_len * layers * (4 * ff + 10 * d) * f4 + logits
    moments = (3 * d * d + ff * ff) * f4 + 16 * (ff * ff + d * d)
    ct = reload_check
    converter = 0 if ct else CONVERTER_PROCESS_BYTES + max(vocab * d, ff * d) * (f4 + 2)
    every = layers * one_layer // f4 + vocab * d * (1 if tied else 2)
    reload = every * (saved_bytes if offload != "none" else f4) if ct else 0
    return {"process": PROCESS_BYTES, "resident": resident, "model": model, "hidden_states": hidden,
            "fisher": fisher + head, "moments": moments, "converter": converter, "reload": reload,
            "vocab_pass": 2 * head,
            "peak": PROCESS_BYTES + resident + model + max(fisher + head, hidden + moments, converter, reload,
                                                           2 * head)}


def size_peak(**kwargs) -> int:
    """:func:`size_components`' peak (bytes)."""
    return size_components(**kwargs)["peak"]


def size_peak_of(config, *, offload: str, dtype: str = "float32", tokens: int = 16384,
                 reload_check: bool = False) -> int | None:
    """:func:`size_peak` for a Hugging Face ``config`` (its text config for a multimodal one), the weights in
    ``dtype`` (the float32 estimate scaled; ``reload_check`` as :func:`size_components`); None where the config
    lacks a decoder's shape fields."""
    cfg = getattr(config, "text_config", None) or config
    try:
        d, ff, layers, vocab = (int(getattr(cfg, k)) for k in ("hidden_size", "intermediate_size",
                                                               "num_hidden_layers", "vocab_size"))
    except (AttributeError, TypeError):
        return None
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0) or None
    kv = int(getattr(cfg, "num_key_value_heads", 0) or 0) or heads
    peak = size_peak(d=d, ff=ff, layers=layers, vocab=vocab, tokens=tokens, heads=heads, kv_heads=kv,
                     tied=bool(getattr(config, "tie_word_embeddings", False)), offload=offload,
                     reload_check=reload_check)
    scale = {"float32": 1.0, "auto": 1.0}.get(dtype, 0.5)  # bfloat16 / float16 weights take half
    return int(peak * scale)


def size_work(*, d: int, ff: int, layers: int, vocab: int, tokens: int, fisher_tokens: int = 2048,
              heads: int | None = None, kv_heads: int | None = None) -> dict[str, float]:
    """Floating-point operations of a GGUF size plan's parts, for a Llama-shaped model — the time model's work,
    each part's seconds being its work over a throughput measured on a smaller run
    (``tools/memory/bench_size_memory.py``, ``docs/large-models.md``):

    * ``statistics``: Ĥ's forward over ``tokens`` (2 · layer weights a token) and its products
      (``2 · (3d² + ff²)`` a token a layer: q/k/v and gate/up share their input), and F's pass over
      ``fisher_tokens`` (forward, the recomputed forward, backward: 8 · weights a token) with the output head's
      logits and gradient;
    * ``pricing``: the GPTQ factor of every layer's four distinct Ĥ (counted as ``n³`` a factor here, as when the
      throughputs were measured: then a float64 Cholesky and a triangular inverse; now a float32 Cholesky alone,
      ``n³/3``, so the projected time overstates); the types' roundings of the sampled rows are far smaller;
    * ``rounding``: the chosen plan's GPTQ over every row (``2 · rows · n²`` a tensor), counted with the factors
      made again, as when the throughputs were measured; a GGUF run now reads pricing's factors (kept in memory, or
      on disk where the moments are spilled), so the projected rounding overstates by its ``factors``.

    Attention's own products (``seq_len`` long windows) and the layer's norms are left out."""
    heads = heads or max(1, d // 128)
    kv = (kv_heads or heads) * (d // heads)
    linear = layer_params(d, ff, heads, kv_heads or heads) - 2 * d  # q, o; k, v; gate, up, down (no norms)
    grams = 3 * d * d + ff * ff
    statistics = layers * (2 * linear + 2 * grams) * tokens + (8 * layers * linear + 6 * vocab * d) * fisher_tokens
    factors = layers * (3 * d ** 3 + ff ** 3)
    gptq = layers * 2 * (d * d * d + kv * d * d * 2 + d * d * d + 2 * ff * d * d + d * ff * ff) + 2 * vocab * d * d
    return {"statistics": float(statistics), "pricing": float(factors), "rounding": float(factors + gptq)}
