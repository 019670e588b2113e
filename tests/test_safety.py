"""Nothing is lost: ``--overwrite`` never deletes what a run reads, the current
directory, a parent of it or the home folder, nor a folder that is not an
earlier compressor output; output locations are checked before any model is
loaded; leftovers of killed runs are cleaned up.

Every case hashes every file around the output (recipe, data, siblings,
``sub/important.txt``) before and after.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict, write_recipe  # noqa: F401  (isolated is an autouse fixture)

from compressor.cli import main
from compressor.inputs.safety import check_output_folder, clean_stale_temps, is_compressor_output, OutputError

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder (the cwd): recipe, data files, a model, sub/important.txt."""
    proj = tmp_path / "project"
    (proj / "sub").mkdir(parents=True)
    (proj / "sub" / "important.txt").write_text("do not lose me")
    (proj / "notes.md").write_text("sibling file")
    data = proj / "data"
    data.mkdir()
    (data / "cal.txt").write_text("calibration text " * 200)
    (data / "eval.txt").write_text("evaluation text " * 200)
    src = save_tiny_checkpoint(tmp_path / "model", "llama")
    d = recipe_dict(src, proj / "out")
    d["calibration"]["dataset"] = str(data / "cal.txt")
    d["evaluation"]["dataset"] = str(data / "eval.txt")
    write_recipe(proj / "myrecipe.yaml", d)
    monkeypatch.chdir(proj)
    return proj


OVERWRITE_CASES = [
    # id, --output (relative to the project folder), words expected in the message
    ("output-is-cwd", ".", ["contains the recipe", "delete"]),
    ("output-is-parent-of-cwd", "..", ["contains"]),
    ("output-holds-calibration-data", "data", ["calibration.dataset"]),
    ("output-is-a-sub-folder-with-files", "sub", ["not an earlier compressor output"]),
]


@pytest.mark.parametrize("output, expected", [c[1:] for c in OVERWRITE_CASES], ids=[c[0] for c in OVERWRITE_CASES])
def test_overwrite_never_deletes_inputs(project, capsys, no_loading, output, expected):
    root = project.parent
    before = tree_hashes(root)
    rc = main(["run", "myrecipe.yaml", "--output", output, "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2, err
    for word in expected:
        assert word in err, err
    assert "Traceback" not in err
    assert tree_hashes(root) == before
    assert (project / "sub" / "important.txt").read_text() == "do not lose me"


def test_overwrite_refuses_folder_holding_evaluation_data(project, capsys, no_loading):
    import yaml

    d = yaml.safe_load((project / "myrecipe.yaml").read_text())
    d["calibration"]["dataset"] = "embedded"
    recipe = write_recipe(project / "r2.yaml", d)
    before = tree_hashes(project.parent)
    assert main(["run", str(recipe), "--output", "data", "--overwrite"]) == 2
    assert "evaluation.dataset" in capsys.readouterr().err
    assert tree_hashes(project.parent) == before


def test_overwrite_refuses_home_and_cache(project, capsys, no_loading, monkeypatch):
    home = project / "sub"
    monkeypatch.setenv("HOME", str(home))
    before = tree_hashes(project.parent)
    assert main(["run", "myrecipe.yaml", "--output", str(home), "--overwrite"]) == 2
    assert "home folder" in capsys.readouterr().err
    # the statistics cache (when the recipe uses it) is read too
    cache = project / "cachebox" / "stats"
    cache.mkdir(parents=True)
    (cache / "x.safetensors").write_bytes(b"entry")
    monkeypatch.setenv("COMPRESSOR_CACHE", str(cache))
    assert main(["run", "myrecipe.yaml", "--output", str(project / "cachebox"), "--overwrite",
                 "--set", "measure.cache=true"]) == 2
    assert "statistics cache" in capsys.readouterr().err
    assert (cache / "x.safetensors").read_bytes() == b"entry"
    assert {k: v for k, v in tree_hashes(project.parent).items() if "cachebox" not in k} == before


def test_overwrite_replaces_an_earlier_output(project, capsys):
    """The intended use: a second run over the first run's folder."""
    assert main(["run", "myrecipe.yaml", "--output", "out"]) == 0
    assert is_compressor_output(project / "out")
    others = {k: v for k, v in tree_hashes(project.parent).items() if not k.startswith("project/out/")}
    assert main(["run", "myrecipe.yaml", "--output", "out"]) == 2  # no --overwrite: refused
    assert main(["run", "myrecipe.yaml", "--output", "out", "--overwrite"]) == 0
    capsys.readouterr()
    assert {k: v for k, v in tree_hashes(project.parent).items() if not k.startswith("project/out/")} == others
    assert sorted(p.name for p in project.iterdir()) == ["data", "myrecipe.yaml", "notes.md", "out", "sub"]


def test_recognises_earlier_output_by_report_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"schema": "compressor.report/v1"}))
    assert is_compressor_output(out)
    assert check_output_folder(out, overwrite=True) == out.resolve()
    (out / "report.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(OutputError, match="not an earlier compressor output"):
        check_output_folder(out, overwrite=True)


# --------------------------------------------------------------------------------------------------
# --report: checked up front; a failure after publishing is not "invalid input"
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/no/such/dir/report.json", "DIR", "RECIPE"])
def test_bad_report_path_fails_before_loading(project, capsys, no_loading, where):
    report = {"DIR": str(project / "sub"), "RECIPE": str(project / "myrecipe.yaml")}.get(where, where)
    before = tree_hashes(project.parent)
    rc = main(["run", "myrecipe.yaml", "--report", report])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--report" in err
    assert tree_hashes(project.parent) == before
    assert not (project / "out").exists()


def test_report_write_failure_after_publishing_is_exit_1(project, capsys, monkeypatch):
    import shutil

    from compressor.pipeline import runner as pipeline

    real_oneshot = pipeline.oneshot
    report_dir = project / "reports"
    report_dir.mkdir()

    def run_then_remove_report_dir(*args, **kw):
        result = real_oneshot(*args, **kw)
        shutil.rmtree(report_dir)  # e.g. a network mount went away during the run
        return result

    monkeypatch.setattr(pipeline, "oneshot", run_then_remove_report_dir)  # the CLI's run is a layer over oneshot
    rc = main(["run", "myrecipe.yaml", "--report", str(report_dir / "report.json")])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    assert "was published at" in captured.err and "report could not be written" in captured.err
    assert "status: success" in captured.out  # the summary is printed first
    assert (project / "out" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# Leftovers of a killed save
# --------------------------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_folders_of_dead_runs_are_removed(project, capsys):
    dead = _dead_pid()
    stale = project / f".out.tmp-{dead}"
    (stale / "big").mkdir(parents=True)
    (stale / "big" / "model.safetensors").write_bytes(b"x" * 1000)
    alive = project / f".out.tmp-{1}"  # pid 1 is always alive: never touched
    alive.mkdir()
    other = project / f".other.tmp-{dead}"  # another output's leftover: not ours to judge
    other.mkdir()
    assert main(["run", "myrecipe.yaml", "--output", "out"]) == 0
    assert not stale.exists()
    assert alive.is_dir() and other.is_dir()
    err = capsys.readouterr().err
    assert f"WARNING compressor.inputs.safety: removed {stale}" in err and f"process {dead} no longer exists" in err


def test_clean_stale_temps_ignores_files_and_live_pids(tmp_path):
    out = tmp_path / "out"
    dead = _dead_pid()
    (tmp_path / f".out.old-{dead}").mkdir()
    (tmp_path / f".out.tmp-{dead}.txt").write_text("not a leftover name")
    removed = clean_stale_temps(out)
    assert [p.name for p in removed] == [f".out.old-{dead}"]
    assert (tmp_path / f".out.tmp-{dead}.txt").exists()
