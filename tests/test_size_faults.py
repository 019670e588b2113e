"""A size run's faults as a new user meets them (issue 57, item 5): each is a finding of that probe, on a tiny
Llama with a byte-level tokenizer (what the gguf writer can carry) planned to ``Q8_0``.

SIGTERM (``timeout``, docker, Slurm) removes the work folder and says what happened; a disk without room is
refused up front with the numbers, and a full disk names the file and the space; ``--overwrite`` keeps what
compressor did not write; ``--no-cache`` reaches the prices; an interrupted size run says it starts over.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tiny import TEXT, byte_level_tokenizer

from compressor.cli import main
from compressor.core.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_TERMINATED

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


@pytest.fixture
def recipe(tmp_path) -> Path:
    """A size recipe (``Q8_0``) on a tiny Llama saved with its tokenizer, output ``tmp_path / "out"``."""
    import numpy as np
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256)).float().eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    byte_level_tokenizer(TEXT).save_pretrained(src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": str(src), "dtype": "float32"},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 1024, "seq_len": 32},
        "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": {"ppl_budget": 5.0}, "measure": {"cache": False},
        "output": {"path": str(tmp_path / "out"), "size": "Q8_0"},
    }))
    return path


def _leftovers(tmp_path: Path) -> list[str]:
    """What a run of output ``out`` may leave beside it: work folder, staging, lock, run state."""
    return sorted(p.name for p in tmp_path.glob(".out.*"))


# --------------------------------------------------------------------------------------------------
# SIGTERM and Ctrl-C
# --------------------------------------------------------------------------------------------------


def test_sigterm_during_a_size_run_removes_its_work_folder_and_says_so(tmp_path, recipe, isolated_cache):
    """``timeout`` / ``docker stop`` / Slurm send SIGTERM: it unwinds the run as Ctrl-C does — the work folder
    (F16 and preset) and any staging removed, the lock released, the message names the signal and says a size
    run starts over — and the exit code is 143 (docs/exit-codes.md)."""
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "COMPRESSOR_CACHE_DIR": str(isolated_cache),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "compressor", "run", str(recipe)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".out.size-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before its work folder was seen: {proc.communicate()[1][-2000:]}"
        assert list(tmp_path.glob(".out.size-*")), "no work folder within the time allowed"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_TERMINATED == 143, err[-2000:]
    assert "terminated (SIGTERM)" in err and "work folder" in err and "does not resume" in err, err[-2000:]
    assert "Traceback" not in err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_sigterm_raises_terminated_and_waits_for_a_deferred_block():
    """The mechanism: under the command line's handler SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``,
    exit 143); another within the grace period is ignored (the clean-up finishes); a block that must not stop
    half-way (publishing) finishes first; the previous handler is back after."""
    from compressor.core.errors import Terminated, exit_code_for
    from compressor.core.signals import signals_deferred, stop_signals_raise

    before = signal.getsignal(signal.SIGTERM)
    with stop_signals_raise():
        with pytest.raises(Terminated) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        os.kill(os.getpid(), signal.SIGTERM)  # a second one, right after: ignored
        time.sleep(0.1)
    assert isinstance(stop.value, KeyboardInterrupt) and exit_code_for(stop.value) == 143
    finished = []
    with pytest.raises(Terminated):
        with stop_signals_raise(), signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            finished.append(True)
    assert finished == [True] and signal.getsignal(signal.SIGTERM) is before


def test_an_interrupted_size_run_says_it_starts_over(tmp_path, recipe, capsys, monkeypatch):
    """The interrupt message of a size run is true: it does not resume (its statistics are not kept), so it
    says to run the same command again without --resume, and it leaves no run state to resume from."""
    import compressor.pipeline.size.prices as prices

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prices, "measure_and_price", stopped)  # Ctrl-C while the statistics are measured
    assert main(["run", str(recipe)]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "does not resume" in err and "without --resume" in err, err
    assert "start over" in err and "continue where it stopped" not in err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# Disk space
# --------------------------------------------------------------------------------------------------


def test_a_disk_without_room_for_the_f16_is_refused_up_front(tmp_path, recipe, capsys, monkeypatch):
    """Before the F16 is written, the run adds up what it will write (the F16 at two bytes a weight, the preset,
    the planned file) and refuses a disk without room: exit 2, the numbers, and where to put the work folder."""
    import compressor.output.gguf.converter as converter

    def never(*args, **kwargs):
        raise AssertionError("the F16 was written")

    monkeypatch.setattr(converter, "convert", never)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1000))
    assert main(["run", str(recipe)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "not enough disk space" in err and "(1,000 bytes) is free there" in err, err
    assert "F16 of the model's" in err and "Q8_0" in err and "output.workdir" in err and "beside the output" in err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("failure", [OSError("65536 requested and 52128 written"),  # numpy's tofile
                                     OSError(errno.ENOSPC, "No space left on device")], ids=["short-write", "enospc"])
def test_a_full_disk_names_the_file_the_space_and_the_work_folder(tmp_path, recipe, capsys, monkeypatch, failure):
    """The disk fills while the F16 is written: the error names the file, what is free and what the run
    needs, and that the work folder sits beside the output (or output.workdir); nothing is left behind."""
    import compressor.output.gguf.converter as converter

    def full(folder, path, workdir, **kwargs):  # llama.cpp's converter writing the F16
        Path(path).write_bytes(b"\0" * 52128)
        raise failure

    monkeypatch.setattr(converter, "convert", full)
    assert main(["run", str(recipe)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "the disk is full" in err and "f16.gguf" in err and str(tmp_path) in err, err
    assert "is free there" in err and "this run writes about" in err and "F16 of the model's" in err
    assert "beside the output" in err and "output.workdir" in err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_output_workdir_puts_the_f16_elsewhere_and_removes_it(tmp_path, recipe, capsys, monkeypatch):
    """``output.workdir``: the work folder goes there (a scratch disk), and is removed as beside the output."""
    import compressor.output.gguf.converter as converter

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    written = []

    def stopped(folder, path, workdir, **kwargs):  # llama.cpp's converter writing the F16
        written.append(Path(path))
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "convert", stopped)
    assert main(["run", str(recipe), "--set", f"output.workdir={scratch}"]) == EXIT_INTERRUPTED
    assert len(written) == 1 and written[0].name == "f16.gguf" and written[0].parent.parent == scratch
    assert written[0].parent.name.startswith(".out@") and list(scratch.iterdir()) == []
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("where,match", [("missing", "does not exist"), ("out/inside", "inside the output folder")])
def test_a_workdir_that_cannot_be_used_is_refused_before_loading(tmp_path, recipe, capsys, no_loading, where, match):
    assert main(["validate", str(recipe), "--set", f"output.workdir={tmp_path / where}"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "output.workdir" in err and match in err, err


def test_a_workdir_without_a_size_is_refused(tmp_path, recipe, capsys, no_loading):
    assert main(["validate", str(recipe), "--set", "output.size=null", "--set", f"output.workdir={tmp_path}"]) == 2
    assert "output.workdir" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# --overwrite keeps what compressor did not write
# --------------------------------------------------------------------------------------------------


def _earlier_output(out: Path, *, listed: bool) -> None:
    """An earlier size output with a stale shard of another format, and what a user added beside it."""
    out.mkdir()
    files = ["README.md", "model.gguf", "model-00001-of-00002.safetensors", "recipe.yaml", "report.json"]
    for name in files[:-1]:
        (out / name).write_text("from the earlier run")
    report = {"schema": "compressor.report/v1", **({"files": files} if listed else {})}
    (out / "report.json").write_text(json.dumps(report))
    (out / "NOTES.txt").write_text("my notes")
    (out / "mydata").mkdir()
    (out / "mydata" / "eval.jsonl").write_text('{"text": "mine"}\n')


@pytest.mark.parametrize("listed", [True, False], ids=["files-listed", "written-before-the-list"])
def test_added_entries_are_what_compressor_did_not_write(tmp_path, listed):
    from compressor.inputs.safety import added_entries

    _earlier_output(tmp_path / "out", listed=listed)
    assert added_entries(tmp_path / "out") == ["NOTES.txt", "mydata"]


def test_overwrite_keeps_the_files_a_user_added_to_an_earlier_output(tmp_path, recipe, capsys):
    """``--overwrite`` replaces what compressor wrote (the stale shard goes) and keeps the user's notes and data
    folder, as they were; the new report lists the files it wrote, for the next ``--overwrite``."""
    out = tmp_path / "out"
    _earlier_output(out, listed=True)
    assert main(["run", str(recipe), "--overwrite"]) == EXIT_OK
    assert (out / "NOTES.txt").read_text() == "my notes"
    assert (out / "mydata" / "eval.jsonl").read_text() == '{"text": "mine"}\n'
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "model.gguf").read_bytes()[:4] == b"GGUF"
    report = json.loads((out / "report.json").read_text())
    assert report["files"] == ["README.md", "model.gguf", "model.imatrix", "recipe.yaml", "report.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(report["files"] + ["NOTES.txt", "mydata"])
    assert _leftovers(tmp_path) == []


def test_overwrite_refuses_a_user_file_a_new_output_would_replace(tmp_path, recipe, capsys, no_loading):
    """A file the earlier output's report does not list but that is named like one compressor writes
    (``tokenizer.json``) would be replaced: refused up front (exit 2), naming it, nothing touched."""
    out = tmp_path / "out"
    _earlier_output(out, listed=True)
    (out / "tokenizer.json").write_text("my own tokenizer")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["run", str(recipe), "--overwrite"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "would replace" in err and "NOTES.txt" not in err, err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


# --------------------------------------------------------------------------------------------------
# --no-cache
# --------------------------------------------------------------------------------------------------


def test_no_cache_reprices_a_size_plan(tmp_path, recipe, capsys, isolated_cache):
    """``--no-cache`` reaches the size path: with the prices of the same model and text in the cache
    (``measure.cache: true``), a run given ``--no-cache`` measures and prices again."""
    out = tmp_path / "out"
    assert main(["run", str(recipe), "--set", "measure.cache=true"]) == EXIT_OK
    assert not json.loads((out / "report.json").read_text())["size_plan"]["prices_from_cache"]
    assert any(p.name.startswith("prices-") for p in isolated_cache.rglob("*")), "the prices were not cached"
    capsys.readouterr()
    assert main(["run", str(recipe), "--set", "measure.cache=true", "--overwrite", "--no-cache"]) == EXIT_OK
    assert not json.loads((out / "report.json").read_text())["size_plan"]["prices_from_cache"]
    assert "from the cache" not in capsys.readouterr().err
