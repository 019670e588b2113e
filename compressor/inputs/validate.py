"""The input-validation stage: everything about a run's inputs that can be
checked with the file system alone, before any model loads.

* :func:`run_reads` — every local file or folder a run reads (the output must
  never be, contain or replace one of them);
* :func:`check_inputs` — sources exist and are readable, data files are
  usable, the output location is safe to write.

``run``, ``profile`` and ``validate`` call it first; every failure is a
:class:`~compressor.core.errors.RecipeError` naming the field (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from compressor.core.errors import InputError, RecipeError
from compressor.recipe.schema import Recipe


def text_sources(recipe: Recipe) -> list[tuple[str, TextSource]]:
    """``(field path, source)`` of every text the run reads: each calibration source (not the model's own
    writing, :meth:`~compressor.recipe.schema.CalibrationConfig.read_sources`), then each evaluation domain."""
    from compressor.inputs.data import TextSource

    cal = [(field, TextSource(s.source, s.config, s.split, s.text_column))
           for field, s in recipe.calibration.read_sources()]
    return cal + [(f"{section}.dataset", TextSource(e.dataset, e.config, e.split, e.text_column))
                  for section, e in recipe.data_sections()[1:]]


def run_reads(recipe: Recipe) -> list[tuple[str, Path]]:
    """``(description, path)`` of every local file or folder a run reads: the
    output must never be, contain or replace any of them."""
    from compressor.engine.cache import cache_dir
    from compressor.inputs.data import EMBEDDED_SOURCES

    reads: list[tuple[str, Path]] = []
    if recipe._source_file is not None:
        reads.append(("the recipe", recipe._source_file))
    for field, source in text_sources(recipe):
        ds = source.dataset
        if ds not in EMBEDDED_SOURCES and Path(ds).expanduser().exists():
            reads.append((field, Path(ds).expanduser()))
    src = Path(recipe.model.source).expanduser()
    if not recipe.model.source.startswith("pkg:") and src.exists():
        reads.append(("model.source", src))
    if recipe.measure.cache:
        reads.append(("the statistics cache", cache_dir()))
    return reads


def check_inputs(recipe: Recipe, *, need_output: bool = True, check_source: bool = True) -> None:
    """Checks that need the file system but no model: sources exist and are
    readable, data files are usable, the output is safe to write.

    ``check_source=False``: the model is an object handed in, ``model.source`` only names it.
    Raises :class:`RecipeError` naming the field.
    """
    from compressor.engine.cache import cache_dir
    from compressor.inputs.checks import DataFileError, check_data_source
    from compressor.inputs.modelfiles import check_model_files
    from compressor.inputs.data import TextSource
    from compressor.inputs.load import resolve_source

    src = None
    if check_source:
        try:
            src = resolve_source(recipe.model.source, recipe.model.gguf_file)
        except FileNotFoundError as e:
            raise RecipeError(f"model.source: {e}") from None
        try:
            check_model_files(src)
        except InputError as e:
            raise RecipeError(f"model.source: {e}") from None
    check_device(recipe.model.device, recipe.model.offload)
    if src is not None and src.is_local:
        check_not_compressed(src)
        from compressor.inputs.load import model_config

        check_context(recipe, model_config(src, trust_remote_code=recipe.model.trust_remote_code,
                                           revision=recipe.model.revision))
    check_task_inputs(recipe)
    if recipe.calibration.writes_self():
        check_writable_dir(cache_dir(), "calibration.dataset: self-written calibration text is cached in the "
                           "statistics cache folder", fix="set COMPRESSOR_CACHE to a writable folder")
    for field, source in text_sources(recipe):
        try:
            check_data_source(source)
        except (FileNotFoundError, DataFileError) as e:
            raise RecipeError(f"{field}: {e}") from None
    if not need_output:
        return
    if recipe.output.path is None:
        raise RecipeError("output.path: required; set it in the recipe or pass --output DIR")
    check_path_text(recipe.output.path, "output.path")
    from compressor.inputs.safety import OutputError, check_output_folder

    try:
        check_output_folder(recipe.output.path, overwrite=recipe.output.overwrite, reads=run_reads(recipe),
                            model_dir=src.path if src is not None and src.is_local else None)
    except OutputError as e:
        raise RecipeError(f"output.path: {e}") from None


def check_task_inputs(recipe: Recipe) -> None:
    """``evaluation.tasks`` needs lm-eval installed (the ``eval`` extra) and its ``task_paths`` folders;
    a :class:`~compressor.core.errors.MissingExtraError` / :class:`RecipeError` (exit 2) otherwise."""
    from compressor.core.extras import require

    section = recipe.task_section()
    if section is None:
        return
    require("lm_eval", f"evaluation.tasks ({', '.join(section.tasks)})")
    for folder in section.task_paths:
        if not Path(folder).expanduser().is_dir():
            raise RecipeError(f"evaluation.task_paths: {folder} is not a folder; give folders of lm-eval task "
                              "YAML files (see docs/evaluation.md)")


def check_device(device: str, offload: str = "none", field: str = "model.device") -> None:
    """``cuda`` needs a GPU that this torch can use; said before anything loads, with the fix."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise RecipeError(f"{field}: cuda, but torch finds no CUDA GPU on this machine (torch {torch.__version__}, "
                          f"{built}); use {field}: cpu (or auto, which takes a GPU when there is one), or run on a "
                          "machine with a GPU and a CUDA build of torch")


def check_not_compressed(src) -> None:
    """A compressor output with compressor's own classes is not a source: its FFNs are replacements already."""
    import json

    if src.gguf_file:
        return
    try:
        cfg = json.loads((Path(src.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # check_model_files has said what is wrong with it
    comp = cfg.get("compression") if isinstance(cfg, dict) else None
    model_type = str(cfg.get("model_type", "")) if isinstance(cfg, dict) else ""
    if isinstance(comp, dict) and model_type.startswith("compressed_"):
        original = comp.get("source_model")
        raise RecipeError(
            f"model.source: {src.path} is a compressor output (model_type {model_type}): its FFN blocks are "
            "compressor's replacements already, which a second run cannot profile or cut. Compress the original "
            "model instead" + (f" ({original})" if original else "") + " with a larger cut (policy.ppl_budget, "
            "policy.ffn_keep)")


def check_context(recipe: Recipe, config) -> None:
    """Every window fits the model's context: past ``max_position_embeddings`` the gate would measure text
    the model was never built to read. Needs the config only."""
    from compressor.inputs.load import context_length

    limit = context_length(config)
    if limit is None:
        return
    cal = recipe.calibration
    # self-written rows are the prompt (BOS + one word) plus seq_len sampled tokens
    need = cal.seq_len + (2 if cal.writes_self() else 0)
    sections = [("calibration.seq_len", need, cal.seq_len)] + [
        (f"{name}.seq_len", e.seq_len, e.seq_len) for name, e in recipe.data_sections()[1:]]
    for field, tokens, value in sections:
        if tokens > limit:
            extra = " plus the 2-token prompt of self-written text" if tokens != value else ""
            raise RecipeError(f"{field}: {value}{extra} is longer than the model's context "
                              f"(max_position_embeddings {limit}); use at most {limit - (tokens - value)}")


def check_writable_dir(path: Path, what: str, *, fix: str) -> None:
    """``path`` is (or can be created as) a folder this process may write into; else a RecipeError."""
    import os

    probe = Path(path).expanduser()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise RecipeError(f"{what} ({path}), which cannot be written here; {fix}")


def check_profile_inputs(model: str, data, *, seq_len: int, max_tokens: int, heldout_fraction: float, seed: int,
                         batch_size: int, blocks: str | list[int] | None, dtype: str = "float32",
                         device: str = "cpu", offload: str = "none", output: str | None = None,
                         flags: bool = True, overwrite: bool = False) -> list[int] | None:
    """``profile``'s inputs, checked like a run's before the model loads; returns the parsed block list.

    ``data`` is a :class:`~compressor.inputs.data.TextSource`. Errors name the command-line flag
    (``flags=True``) or the keyword argument."""
    from pydantic import ValidationError

    from compressor.inputs.checks import DataFileError, check_data_source
    from compressor.inputs.load import resolve_source
    from compressor.inputs.modelfiles import check_model_files
    from compressor.recipe.schema import CalibrationConfig, ModelConfig

    def name(field: str) -> str:
        return "--" + field.replace("_", "-") if flags else field

    values = dict(seq_len=seq_len, max_tokens=max_tokens, heldout_fraction=heldout_fraction, seed=seed,
                  batch_size=batch_size)
    for section, fields in ((CalibrationConfig, values), (ModelConfig, dict(dtype=dtype, device=device,
                                                                            offload=offload))):
        try:
            section(**fields)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            from compressor.recipe.yamlsafe import shorten

            raise RecipeError(f"{name(field)}: {err['msg']} (got {shorten(err.get('input'))})") from None
    if max_tokens // seq_len < 2:
        raise RecipeError(f"{name('max_tokens')} {max_tokens} holds fewer than two windows of {name('seq_len')} "
                          f"{seq_len}: one is fitted on and one held out; give at least {2 * seq_len} tokens")
    parsed = parse_blocks(blocks, name("blocks"))
    check_device(device, offload, name("device"))
    try:
        src = resolve_source(model, None)
        check_model_files(src)
    except FileNotFoundError as e:
        raise RecipeError(f"model: {e}") from None
    except InputError as e:
        raise RecipeError(f"model: {e}") from None
    if src.is_local:
        from compressor.inputs.load import context_length, model_config

        try:
            limit = context_length(model_config(src))
        except InputError as e:
            raise RecipeError(f"model: {e}") from None
        except (OSError, ValueError):  # e.g. a config that needs remote code: the loader says what is wrong
            limit = None
        if limit is not None and seq_len > limit:
            raise RecipeError(f"{name('seq_len')}: {seq_len} is longer than the model's context "
                              f"(max_position_embeddings {limit}); use at most {limit}")
    try:
        check_data_source(data)
    except (FileNotFoundError, DataFileError) as e:
        raise RecipeError(f"{name('data')}: {e}") from None
    if output is not None:
        if not str(output).strip():
            raise RecipeError(f"{name('output')}: empty; give a folder for profile.json, profile.md and profile.png")
        out = Path(output).expanduser()
        if out.exists() and not out.is_dir():
            raise RecipeError(f"{name('output')}: {out} is a file; give a folder")
        check_profile_output(out, src, data, overwrite=overwrite, flag=name("output"),
                             overwrite_flag=name("overwrite"))
        check_writable_dir(out, f"{name('output')}: the profile is written into {out}",
                           fix="choose a folder you can write to")
    return parsed


#: What ``compressor profile --output`` writes (compressor.pipeline.profiler.write_profile).
PROFILE_FILES = ("profile.json", "profile.md", "profile.png")


def check_profile_output(out: Path, src, data, *, overwrite: bool, flag: str = "--output",
                         overwrite_flag: str = "--overwrite") -> None:
    """The profile's folder is not the model's own folder, not inside a published compressor output, and
    holds no earlier profile unless ``overwrite``: the same output safety as ``run``."""
    from compressor.inputs.safety import is_compressor_output

    out = out.resolve()
    if src.is_local:
        model_dir = Path(src.path).resolve()
        if out == model_dir or out.is_relative_to(model_dir) or model_dir.is_relative_to(out):
            raise RecipeError(f"{flag}: {out} is, contains or lies inside the model's folder {model_dir}; the "
                              "model's files are never written to — choose another folder, e.g. --output "
                              "profiles/NAME")
    if data.kind() in ("file", "disk"):
        read = Path(data.dataset).expanduser().resolve()
        if out == read or read.is_relative_to(out) and read.name in PROFILE_FILES:
            raise RecipeError(f"{flag}: {out} would overwrite the data file {read}; choose another folder")
    for folder in (out, *out.parents):
        if folder.is_dir() and is_compressor_output(folder):
            raise RecipeError(f"{flag}: {folder} is a published compressor output; writing a profile into it "
                              "would change a model folder other tools read — choose another folder, e.g. "
                              "--output profiles/NAME")
    earlier = [f for f in PROFILE_FILES if (out / f).exists()]
    if earlier and not overwrite:
        raise RecipeError(f"{flag}: {out} holds an earlier profile ({', '.join(earlier)}); choose another folder, "
                          f"or pass {overwrite_flag} to replace those files")
    bad = [f for f in PROFILE_FILES if (out / f).exists() and not (out / f).is_file()]
    if bad:
        raise RecipeError(
            f"{flag}: {out / bad[0]} is not a file, so the profile cannot replace it; choose another folder"
        )


def parse_blocks(blocks: str | list[int] | None, flag: str = "--blocks") -> list[int] | None:
    """``"0,3,7"`` (or a list) → ``[0, 3, 7]``; anything else is a RecipeError naming ``flag``."""
    if blocks is None:
        return None
    items = blocks.split(",") if isinstance(blocks, str) else list(blocks)
    out = []
    for item in items:
        try:
            i = int(str(item).strip())
        except ValueError:
            i = -1
        if i < 0:
            from compressor.recipe.yamlsafe import shorten

            raise RecipeError(f"{flag}: expected comma-separated block indices ≥ 0, such as 0,3,7 "
                              f"(got {shorten(blocks)})")
        out.append(i)
    if not out:
        raise RecipeError(f"{flag}: empty; give block indices such as 0,3,7, or leave it out for all blocks")
    return sorted(set(out))


# Linux limits: a name of at most 255 bytes, a path of at most 4095.
NAME_MAX, PATH_MAX = 255, 4095


def check_path_text(path: str, field: str) -> None:
    """A path the file system can take: not empty, valid UTF-8, names and length within the limits."""
    if not str(path).strip():
        raise RecipeError(f"{field}: empty; give a folder such as out/model")
    try:
        raw = str(Path(path).expanduser().absolute()).encode("utf-8")
    except UnicodeEncodeError:
        raise RecipeError(f"{field}: the path is not valid UTF-8; choose a name in UTF-8") from None
    long = [part for part in raw.split(b"/") if len(part) > NAME_MAX]
    if long or len(raw) > PATH_MAX:
        what = (f"a name of {len(long[0])} bytes (the limit is {NAME_MAX})" if long
                else f"{len(raw)} bytes (the limit is {PATH_MAX})")
        raise RecipeError(f"{field}: the path is too long for the file system: {what}; choose a shorter one")
