"""``compressor clean`` (issue 71, minor finding 10): the work and staging folders a SIGKILLed run leaves are listed
with their sizes and, with ``--remove``, removed — only those whose process no longer exists on this machine; a
running run's folders, one left on another machine, and an earlier output moved aside whose output is missing are
never touched."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from compressor.cli import main


def _dead_pid() -> int:
    """The id of a process that existed and was killed (SIGKILL), as a killed run's is."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    child.wait()
    return child.pid


def test_clean_lists_then_removes_only_the_folders_of_dead_runs(tmp_path, capsys):
    dead, live = _dead_pid(), os.getpid()
    here = socket.gethostname()
    folders = {
        "work": tmp_path / f".out.size-{dead}",  # beside the output
        "scratch": tmp_path / f".out@{here}.size-{dead}",  # under output.workdir
        "staging": tmp_path / f".other.tmp-{dead}",
        "running": tmp_path / f".out.size-{live}",
        "elsewhere": tmp_path / f".out@not-{here}.size-{dead}",
        "moved aside": tmp_path / f".gone.old-{dead}",
    }
    for folder in folders.values():
        folder.mkdir()
    (folders["work"] / "f16.gguf").write_bytes(b"\0" * 3000)
    (tmp_path / "out").mkdir()
    (tmp_path / "notes.txt").write_text("mine")

    assert main(["clean", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert all(f.is_dir() for f in folders.values())  # listing removes nothing
    assert "3 stale folders" in listed and "--remove" in listed, listed
    line = next(ln for ln in listed.splitlines() if str(folders["work"]) in ln)
    assert line.split()[:3] == ["stale", "3.0", "KB"], line
    assert line.endswith(f"{folders['work']}  size run's work folder of out (process {dead} no longer exists)"), line
    assert f"process {live} is running: not touched" in listed
    assert f"on not-{here}: run `compressor clean` there" in listed
    assert "gone itself is missing: rename this folder back to gone" in listed

    assert main(["clean", str(tmp_path), "--remove"]) == 0
    said = capsys.readouterr().out
    assert "removed 3 stale folders (3.0 KB)" in said, said
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(["out", "notes.txt", folders["running"].name, folders["elsewhere"].name,
                           folders["moved aside"].name]), kept

    assert main(["clean", str(tmp_path)]) == 0
    assert f"no stale folders in {tmp_path}" in capsys.readouterr().out


def test_clean_refuses_a_folder_that_does_not_exist(tmp_path, capsys):
    assert main(["clean", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
