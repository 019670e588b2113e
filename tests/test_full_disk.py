"""A full disk, as a new user meets it (issue 71, serious finding 2): the output on a small disk, the work folder
on a scratch disk with room (``output.workdir``).

The run checks each disk against what it will write there — an estimate before the F16, the budget itself
once it is measured, before anything is priced — and refuses (exit 2) a disk without room for the planned file,
naming that disk; a write that fails for want of space anyway (exit 1) names the file whose write failed and the
disk it is on (not the newest file of the work folder on another disk), for GGUF and compressed-tensors alike.
Nothing is left behind. The disk is simulated (a writer raising what numpy, safetensors or the OS raise), and
is a real tmpfs where the test runs as root and may mount one.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tiny import TEXT, byte_level_tokenizer

from compressor.cli import main
from compressor.core.errors import EXIT_ERROR, EXIT_INVALID

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


@pytest.fixture
def recipe(tmp_path) -> Path:
    """A size recipe on a tiny Llama (rows of 128: every compressed-tensors group divides them), output
    ``tmp_path / "disk" / "out"``, its work folder under ``tmp_path / "scratch"``."""
    import numpy as np
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256)).float().eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    byte_level_tokenizer(TEXT).save_pretrained(src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)) + "\n")
    (tmp_path / "disk").mkdir()
    (tmp_path / "scratch").mkdir()
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": str(src), "dtype": "float32"},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 1024, "seq_len": 32},
        "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": {"ppl_budget": 50.0}, "measure": {"cache": False},
        "output": {"path": str(tmp_path / "disk" / "out"), "size": "Q8_0", "workdir": str(tmp_path / "scratch")},
    }))
    return path


CTENSORS = ["--set", "output.size=W4A16", "--set", "output.formats=[compressed-tensors]"]


def _left(tmp_path: Path) -> list[str]:
    """What the run left on either disk."""
    return sorted(p.name for p in [*(tmp_path / "disk").iterdir(), *(tmp_path / "scratch").iterdir()])


def _staged(folder: Path) -> bool:
    return folder.name == f".out.tmp-{os.getpid()}"


# --------------------------------------------------------------------------------------------------
# A write that fails: the file and its disk
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gguf", "compressed-tensors"])
def test_a_full_output_disk_names_the_staged_file_and_its_disk(tmp_path, recipe, capsys, monkeypatch, fmt):
    """The planned file's write fails on the output's disk while the work folder's disk has room: the message
    names ``.out.tmp-PID/<file>`` on the output's disk — the staging folder is gone by the time the size stage
    hears of it, so it is named where the write failed — and nothing is left on either disk."""
    if fmt == "gguf":
        from compressor.output.gguf.writer import GGUFWriter as Writer

        name, failure = "model.gguf", OSError("65536 requested and 52128 written")  # numpy's tofile: no errno
    else:
        pytest.importorskip("compressed_tensors")
        from compressor.output.ctensors.writer import CompressedTensorsWriter as Writer

        class SafetensorError(Exception):  # safetensors' Rust error: no errno, no file name
            pass

        name = "model.safetensors"
        failure = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
    write = Writer.write

    def full(self, request, folder, plan=None):
        if not _staged(folder):  # the uniform anchor, written in the work folder: it fits
            return write(self, request, folder, plan)
        (folder / "config.json").write_text("{}")
        (folder / name).write_bytes(b"\0" * 52128)
        raise failure

    monkeypatch.setattr(Writer, "write", full)
    args = ["run", str(recipe)] + (CTENSORS if fmt != "gguf" else [])
    assert main(args) == EXIT_ERROR
    err = capsys.readouterr().err
    staged = tmp_path / "disk" / f".out.tmp-{os.getpid()}" / name
    assert f"the disk is full: writing {staged} failed" in err, err
    assert type(failure).__name__ in err and "is free there" in err and "the disk mounted at" in err
    assert "this run writes about" in err and "the planned file" in err and "output.workdir" in err
    assert "Traceback" not in err
    assert _left(tmp_path) == [], _left(tmp_path)


def test_an_oserror_names_its_own_file_and_a_bare_error_on_a_roomy_disk_is_not_a_full_disk(tmp_path):
    from compressor.inputs.safety import DiskFullError, as_disk_full

    (tmp_path / "newest.bin").write_bytes(b"x")
    said = as_disk_full(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "the.gguf")),
                        [tmp_path], 0.0, "free space")
    assert isinstance(said, DiskFullError) and said.path == tmp_path / "the.gguf"
    assert str(said).startswith(f"the disk is full: writing {tmp_path / 'the.gguf'} failed (OSError: [Errno 28]")
    assert str(said).endswith(". free space") and "the disk mounted at" in str(said)
    told = said.told("; this run writes 1 byte", "another fix")
    assert told.path == said.path and str(told).endswith("is free there; this run writes 1 byte. another fix")
    # a failure that is not a full disk is not called one (the disk here has room)
    assert as_disk_full(RuntimeError("llama.cpp failed"), [tmp_path], 0.0, "free space") is None
    assert as_disk_full(FileNotFoundError(errno.ENOENT, "gone", "x"), [tmp_path], 0.0, "free space") is None


# --------------------------------------------------------------------------------------------------
# Up front: each disk against what is written there
# --------------------------------------------------------------------------------------------------


def test_the_output_disk_is_checked_against_the_budget_before_pricing(tmp_path, recipe, capsys, monkeypatch):
    """The estimate before the F16 passes; once the budget is measured the output's disk is checked against the
    budget itself, and refused (exit 2) before anything is priced."""
    import compressor.pipeline.size.prices as prices
    import compressor.pipeline.size.workdir as work
    from compressor.output.gguf.target import GGUFTarget

    measured, usage = [], shutil.disk_usage
    budget = GGUFTarget.budget

    def measure(self, *args, **kwargs):
        measured.append(True)
        return budget(self, *args, **kwargs)

    def disk_usage(path):  # the output's disk fills while the F16 is made
        if measured and Path(path).resolve().is_relative_to((tmp_path / "disk").resolve()):
            return shutil._ntuple_diskusage(10 << 20, (10 << 20) - 1000, 1000)
        return usage(path)

    def never(*args, **kwargs):
        raise AssertionError("priced")

    monkeypatch.setattr(GGUFTarget, "budget", measure)
    monkeypatch.setattr(work.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(prices, "measure_and_price", never)
    monkeypatch.setattr(work, "_device", _apart(tmp_path, work._device))  # the two folders on two disks
    assert main(["run", str(recipe)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert measured and "not enough disk space" in err and "the planned file (its budget, " in err, err
    assert f"which holds {tmp_path / 'disk'}" in err and "(1,000 bytes) is free there" in err
    assert "Traceback" not in err
    assert _left(tmp_path) == []


def _apart(tmp_path: Path, device):
    """Which disk a folder is on, with the output's folder on a disk of its own."""
    disk = (tmp_path / "disk").resolve()

    def apart(path):
        mine = path is not None and Path(path).resolve().is_relative_to(disk)
        return -1 if mine else device(path)
    return apart


def _mount(folder: Path, size: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.mark.parametrize("fmt", ["gguf", "compressed-tensors"])
def test_a_real_small_disk_is_refused_up_front_naming_it(tmp_path, recipe, capsys, fmt):
    """The probe's command: the output on a 64 KB tmpfs, the work folder elsewhere. Refused with exit 2, naming
    that disk and what it has free; nothing is left on it. (compressed-tensors' budget is counted before anything
    is written; a GGUF's once the F16 is made.)"""
    if fmt != "gguf":
        pytest.importorskip("compressed_tensors")
    disk = tmp_path / "disk"
    _mount(disk, "64k")
    try:
        args = ["run", str(recipe)] + (CTENSORS if fmt != "gguf" else [])
        assert main(args) == EXIT_INVALID
        err = capsys.readouterr().err
        assert "not enough disk space" in err and f"the disk mounted at {disk}" in err, err
        assert f"which holds {disk} (the planned file" in err and "is free there" in err
        assert "Traceback" not in err
        assert _left(tmp_path) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)
