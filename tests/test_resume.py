"""Resume an interrupted run (compressor.engine.runstate): a run that failed at layer k or at a gate
evaluation, resumed, gives byte-identical weights and the same decisions as an uninterrupted
run, measures no finished layer and repeats no recorded evaluation; a state of another
model, data or recipe is refused (exit 2), as is --resume with nothing to resume."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import yaml

from checkpoints import save_tiny_checkpoint
from test_cli import isolated  # noqa: F401  (autouse: undoes main()'s logging changes)

import compressor
from compressor.cli import main
from compressor.engine.walker import LayerWalker
from compressor.evaluation.gate import Evaluator
from compressor.fitting.kinds.hidden import HiddenUnitKind
from compressor.engine.records import ResumeError, decode, encode
from compressor.engine.runstate import RunState, state_dir

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BASE = {
    "calibration": {"dataset": "embedded", "max_tokens": 1024, "seq_len": 32},
    # 8 windows: 6 for the search, 2 held out to confirm its choice (policy.confirm_fraction 0.25)
    "evaluation": {"max_tokens": 512, "min_tokens": 128, "seq_len": 64, "stride": 64},
    "measure": {"cache": False},
}
SCENARIOS = {
    # greedy: pass A fits every block; the gate sweeps single swaps, then tries blocks one by one
    "greedy": {"replacement": {"kind": "prune", "keep": 0.5},
               "policy": {"strategy": "greedy", "threshold": -100, "ppl_budget": 100.0}},
    # allocate: loss-gradient statistics, curves, bisection (re-solves), then the teacher-target walk
    "allocate": {"replacement": {"kind": "prune", "target": "teacher_output"},
                 "policy": {"strategy": "allocate", "ppl_budget": 100.0, "max_backoff": 2,
                            "allocation": "fisher"}},
}


class Interrupted(RuntimeError):
    pass


def recipe_for(src: Path, out: Path, scenario: str, **policy) -> compressor.Recipe:
    d = json.loads(json.dumps({**BASE, **SCENARIOS[scenario]}))
    d["model"] = {"source": str(src)}
    d["output"] = {"path": str(out)}
    d["policy"].update(policy)
    return compressor.recipe_from_dict(d)


class Counter:
    """Counts finished layer measurements (target, layer) and gate evaluations; can fail once."""

    def __init__(self, mp: pytest.MonkeyPatch, fail_layer: tuple[str, int] | None = None,
                 fail_eval: int | None = None, fail_fit: int | None = None) -> None:
        self.measured: list[tuple[str, int]] = []
        self.evals = 0
        stats, call, fit = LayerWalker._layer_stats, Evaluator.__call__, HiddenUnitKind.fit
        counter = self

        def layer_stats(walker, i, teacher, student, hidden, target, *rest):
            if fail_layer == (target, i) and not counter.measured.count((target, i)):
                raise Interrupted(f"injected failure before layer {i} ({target})")
            out = stats(walker, i, teacher, student, hidden, target, *rest)
            counter.measured.append((target, i))
            return out

        def evaluate(ev, model, desc="evaluate"):
            if counter.evals + 1 == fail_eval:
                raise Interrupted(f"injected failure at evaluation {fail_eval}")
            counter.evals += 1
            return call(ev, model, desc)

        def kind_fit(kind, data, cfg, size):
            if fail_fit is not None and data.index == fail_fit and not getattr(counter, "fit_failed", False):
                counter.fit_failed = True
                raise Interrupted(f"injected failure in the fit of layer {fail_fit}")
            return fit(kind, data, cfg, size)

        mp.setattr(LayerWalker, "_layer_stats", layer_stats)
        mp.setattr(Evaluator, "__call__", evaluate)
        mp.setattr(HiddenUnitKind, "fit", kind_fit)


def outcome(res) -> dict:
    r = res.report
    return {"weights": (res.output / "model.safetensors").read_bytes(), "blocks": r["blocks"],
            "attempts": r["allocation_attempts"], "final": r["perplexity"]["final"],
            "config": json.loads((res.output / "config.json").read_text())["compression"]["blocks"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("resume-src") / "in", "llama")


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict:
    """The uninterrupted run of each scenario, with its measurement and evaluation counts."""
    refs = {}
    for name in SCENARIOS:
        out = tmp_path_factory.mktemp(f"ref-{name}") / "out"
        with pytest.MonkeyPatch.context() as mp:
            counter = Counter(mp)
            res = compressor.run(recipe_for(source, out, name))
        assert res.exit_code == compressor.EXIT_OK, res.report["message"]
        assert not state_dir(out).exists(), "the run state outlived a published run"
        refs[name] = {"outcome": outcome(res), "measured": counter.measured, "evals": counter.evals}
    return refs


def record_files(folder: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in folder.glob(pattern))


@pytest.mark.parametrize("scenario, failure", [
    ("greedy", {"fail_fit": 1}),                          # pass A, after layer 1's statistics
    ("greedy", {"fail_eval": 4}),                         # in the gate, after the single-swap sweep
    ("allocate", {"fail_layer": ("none", 2)}),            # pass A, before the last layer
    ("allocate", {"fail_eval": 2}),                       # in the bisection
    ("allocate", {"fail_layer": ("teacher_output", 1)}),  # in the teacher-target walk
])
def test_resume_equals_an_uninterrupted_run(tmp_path, source, reference, scenario, failure):
    ref = reference[scenario]
    out = tmp_path / "out"
    recipe = recipe_for(source, out, scenario)
    with pytest.MonkeyPatch.context() as mp:
        Counter(mp, **failure)
        with pytest.raises(Interrupted):
            compressor.run(recipe)
    folder = state_dir(out)
    assert not out.exists() and (folder / "state.json").is_file()
    layers_done = record_files(folder, "*walk*-layer*.safetensors")
    evals_done = record_files(folder, "*eval*.safetensors")
    assert layers_done, "no layer was checkpointed before the failure"

    with pytest.MonkeyPatch.context() as mp:
        counter = Counter(mp)
        res = compressor.run(recipe, resume=True)
    assert res.exit_code == compressor.EXIT_OK, res.report["message"]
    assert res.report["resumed"] is True
    got = outcome(res)
    assert got["weights"] == ref["outcome"]["weights"], "resumed weights differ from the uninterrupted run's"
    assert got == ref["outcome"]
    # finished layers were not measured again, recorded evaluations not repeated
    assert len(counter.measured) == len(ref["measured"]) - len(layers_done)
    assert counter.evals == ref["evals"] - len(evals_done)
    assert not folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _interrupted_cli_run(tmp_path: Path, source: Path, recipe: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        Counter(mp, fail_fit=1)
        assert main(["run", str(path), "--quiet"]) == 1
    assert (state_dir(recipe["output"]["path"]) / "state.json").is_file()
    return path


def test_mismatched_state_is_refused(tmp_path, source, capsys):
    text = tmp_path / "calibration.txt"
    from compressor.inputs.data import _embedded_documents

    docs = _embedded_documents("calibration")
    text.write_text("\n\n".join(docs))
    d = recipe_for(source, tmp_path / "out", "greedy").to_dict()
    d["calibration"]["dataset"] = str(text)
    path = _interrupted_cli_run(tmp_path, source, d)
    capsys.readouterr()

    # a changed measurement setting: refused before the model loads
    changed = dict(d, measure=dict(d["measure"], spike_factor=10.0))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(changed, sort_keys=False))
    assert main(["run", str(other), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "different measurement settings" in err and "Run without --resume to start over" in err

    # changed calibration text: refused once the calibration windows are known
    text.write_text("\n\n".join(reversed(docs)))
    assert main(["run", str(path), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "different calibration data" in err and "Run without --resume" in err
    text.write_text("\n\n".join(docs))

    # a touched model file (size and mtime identify the weights without reading them)
    weights = source / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert main(["run", str(path), "--resume", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "different model" in err and "files" in err
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))

    # the refusals left the state alone: it still resumes
    assert main(["run", str(path), "--resume", "--quiet"]) == 0
    assert not state_dir(tmp_path / "out").exists()


def test_fresh_run_discards_an_old_state(tmp_path, source, capsys):
    d = recipe_for(source, tmp_path / "out", "greedy").to_dict()
    path = _interrupted_cli_run(tmp_path, source, d)
    assert main(["run", str(path)]) == 0
    assert "discarding the saved state of an earlier interrupted run" in capsys.readouterr().err
    assert not state_dir(tmp_path / "out").exists()


def test_resume_with_nothing_to_resume(tmp_path, source, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_for(source, tmp_path / "out", "greedy").to_dict(), sort_keys=False))
    assert main(["run", str(path), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "Run without --resume" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_state_removed_when_the_gate_fails(tmp_path, source):
    out = tmp_path / "out"
    res = compressor.run(recipe_for(source, out, "greedy", ppl_budget=0.0, min_blocks=3))
    assert res.exit_code == compressor.EXIT_GATE
    assert not state_dir(out).exists() and not out.exists()


def test_an_input_inside_the_state_folder_is_refused(tmp_path):
    folder = state_dir(tmp_path / "out")
    with pytest.raises(ResumeError, match="resume state"):
        RunState.open(tmp_path / "out", {}, resume=False, reads=[("calibration.dataset", folder / "data.txt")])


def test_a_foreign_folder_at_the_state_path_is_left_alone(tmp_path):
    folder = state_dir(tmp_path / "out")
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ResumeError, match="not a compressor run state"):
        RunState.open(tmp_path / "out", {}, resume=False)
    assert (folder / "notes.txt").read_text() == "mine"


def test_records_round_trip_exactly():
    from compressor.fitting.kinds import Fitted

    f = Fitted(kind="prune", index=2, config={"units": 3, "act": "silu", "gated": True},
               tensors={"out.weight": torch.randn(4, 3, dtype=torch.float64).T, "out.bias": torch.zeros(0)},
               params=7, heldout_r2=float("nan"), warnings=["w"])
    value = {1: f, "key": ("prune", 4, "obs"), "x": [0.1 + 0.2, float("inf"), None, True]}
    data, tensors = encode(value)
    back = decode(json.loads(json.dumps(data)), tensors)
    assert back["key"] == ("prune", 4, "obs") and back["x"][0] == 0.1 + 0.2 and back["x"][1] == float("inf")
    g = back[1]
    assert g.config == f.config and g.params == 7 and g.heldout_r2 != g.heldout_r2 and g.warnings == ["w"]
    assert all(torch.equal(g.tensors[k], f.tensors[k]) for k in f.tensors)


# -- measurements kept across budgets ------------------------------------------------------------

def _count_gradient_passes(mp: pytest.MonkeyPatch) -> list[int]:
    from compressor.policy import compress as policy_compress

    calls: list[int] = []
    real = policy_compress.output_grad_moments

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    mp.setattr(policy_compress, "output_grad_moments", counted)
    return calls


def test_other_budget_takes_the_kept_measurements(tmp_path, source, caplog):
    """A run kept with --keep-state lends its measurements to a run at another budget (another
    output): pass A, the loss gradients and the baseline are not measured again, the donor is left
    as it was, and the result is byte-identical to a fresh run at that budget."""
    caplog.set_level(logging.INFO, logger="compressor")
    first = tmp_path / "first"
    res = compressor.run(recipe_for(source, first, "allocate"), keep_state=True)
    assert res.exit_code == compressor.EXIT_OK
    donor = state_dir(first)
    donor_files = {p.name: p.stat().st_size for p in donor.iterdir()}
    assert any(n.startswith("gate-") for n in donor_files) and "sensitivity.safetensors" in donor_files
    assert "run state kept at" in caplog.text

    other = recipe_for(source, tmp_path / "second", "allocate", ffn_keep=0.6, ppl_budget=200.0, max_backoff=1)
    with pytest.MonkeyPatch.context() as mp:
        counter, grads = Counter(mp), _count_gradient_passes(mp)
        got = compressor.run(other, measurements_from=first)
    assert got.exit_code == compressor.EXIT_OK, got.report["message"]
    assert grads == [], "the loss-gradient pass ran again"
    assert all(target != "none" for target, _ in counter.measured), "pass A measured a layer again"
    assert not state_dir(tmp_path / "second").exists()
    assert {p.name: p.stat().st_size for p in donor.iterdir()} == donor_files, "the donor state was touched"

    with pytest.MonkeyPatch.context() as mp:
        fresh_counter, fresh_grads = Counter(mp), _count_gradient_passes(mp)
        fresh = compressor.run(recipe_for(source, tmp_path / "fresh", "allocate", ffn_keep=0.6, ppl_budget=200.0,
                                          max_backoff=1))
    assert fresh_grads == [1] and any(t == "none" for t, _ in fresh_counter.measured)
    assert outcome(got) == outcome(fresh)
    assert got.report["allocation_attempts"][0]["ffn_keep_target"] == 0.6


def test_resume_with_a_changed_budget_reruns_only_the_gate(tmp_path, source, caplog):
    caplog.set_level(logging.INFO, logger="compressor")
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        Counter(mp, fail_eval=2)  # interrupted in the bisection: gate records exist
        with pytest.raises(Interrupted):
            compressor.run(recipe_for(source, out, "allocate"))
    assert record_files(state_dir(out), "gate-eval*.safetensors")
    changed = recipe_for(source, out, "allocate", ffn_keep=0.6, ppl_budget=200.0)
    with pytest.MonkeyPatch.context() as mp:
        counter = Counter(mp)
        res = compressor.run(changed, resume=True)
    assert res.exit_code == compressor.EXIT_OK
    assert "only the gate settings" in caplog.text
    assert all(target != "none" for target, _ in counter.measured)
    fresh = compressor.run(recipe_for(source, tmp_path / "fresh", "allocate", ffn_keep=0.6, ppl_budget=200.0))
    assert outcome(res) == outcome(fresh)


def test_measurements_are_refused_from_another_setup(tmp_path, source, capsys):
    first = tmp_path / "first"
    d = recipe_for(source, first, "allocate").to_dict()
    path = tmp_path / "first.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    second = ["-o", str(tmp_path / "second"), "--quiet"]
    # nothing kept
    assert main(["run", str(path), *second, "--measurements-from", str(first)]) == 2
    assert "--keep-state" in capsys.readouterr().err
    assert main(["run", str(path), "--keep-state", "--quiet"]) == 0
    assert state_dir(first).is_dir()
    # a measurement setting differs
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(dict(d, measure=dict(d["measure"], spike_factor=10.0)), sort_keys=False))
    assert main(["run", str(changed), *second, "--measurements-from", str(first)]) == 2
    err = capsys.readouterr().err
    assert "different measurement settings" in err and "only the policy's gate settings may differ" in err
    # the output asks for other FFN widths (the output section is not hashed, its width multiple is keyed)
    wider = tmp_path / "wider.yaml"
    wider.write_text(yaml.safe_dump(dict(d, output=dict(d["output"], width_multiple=8)), sort_keys=False))
    assert main(["run", str(wider), *second, "--measurements-from", str(first)]) == 2
    err = capsys.readouterr().err
    assert "FFN width multiple: saved 1, now 8" in err and "output.width_multiple" in err
    # both ways of starting from a saved state at once
    assert main(["run", str(path), *second, "--measurements-from", str(first), "--resume"]) == 2
    assert "--resume and --measurements-from" in capsys.readouterr().err
    assert not (tmp_path / "second").exists() and not state_dir(tmp_path / "second").exists()


@pytest.mark.parametrize("interrupted", [False, True])
def test_spilled_statistics_are_read_from_the_records(tmp_path, source, reference, monkeypatch, interrupted):
    """A run whose statistics spill to disk keeps no second copy of what its records hold (the
    store reads them back from there), writes nothing to the system's temporary folder, and gives
    the same result, also when resumed."""
    import tempfile

    from compressor.engine.spill import BlockStore
    from compressor.policy import compress as policy_compress

    monkeypatch.setattr(policy_compress, "KEEP_STATS_MEMORY_SHARE", 0.0)  # every run spills
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    copies = []
    real_set = BlockStore.__setitem__
    monkeypatch.setattr(BlockStore, "__setitem__", lambda self, i, d: copies.append(i) or real_set(self, i, d))
    out = tmp_path / "out"
    recipe = recipe_for(source, out, "allocate")
    if interrupted:
        with pytest.MonkeyPatch.context() as mp:
            Counter(mp, fail_eval=2)
            with pytest.raises(Interrupted):
                compressor.run(recipe)
        leftover = state_dir(out) / "compressor-stats-killed"  # what a SIGKILLed run's spill leaves behind
        leftover.mkdir()
        (leftover / "block0.safetensors").write_bytes(b"x" * 10)
    res = compressor.run(recipe, resume=interrupted, keep_state=True)
    assert res.exit_code == compressor.EXIT_OK
    assert copies == [], "statistics the records hold were written again"
    kept = state_dir(out)
    assert (kept / "state.json").is_file() and not [p for p in kept.iterdir() if p.is_dir()], \
        "a temporary folder outlived its run in the state folder"
    assert outcome(res) == reference["allocate"]["outcome"]
    assert list(systmp.iterdir()) == []


def test_another_confirmation_split_takes_the_kept_measurements(tmp_path, source):
    """policy.confirm_fraction is a gate setting: the baseline's teacher pass covers every window and the
    split is taken from it, so a run at another fraction takes the kept measurements (no pass A, no
    baseline pass again) and gets what a fresh run at that fraction gets."""
    first = tmp_path / "first"
    assert compressor.run(recipe_for(source, first, "allocate"), keep_state=True).exit_code == compressor.EXIT_OK
    other = recipe_for(source, tmp_path / "second", "allocate", confirm_fraction=0.5)
    assert other.measurement_sha256() == recipe_for(source, first, "allocate").measurement_sha256()
    with pytest.MonkeyPatch.context() as mp:
        counter, grads = Counter(mp), _count_gradient_passes(mp)
        builds = []
        real = Evaluator.build.__func__
        mp.setattr(Evaluator, "build", classmethod(lambda cls, *a, **k: builds.append(1) or real(cls, *a, **k)))
        got = compressor.run(other, measurements_from=first)
    assert got.exit_code == compressor.EXIT_OK, got.report["message"]
    assert grads == [] and builds == [] and all(target != "none" for target, _ in counter.measured)
    assert got.report["evaluation"]["confirmation"]["windows"] == {"embedded": 4}  # 8 windows, every other
    fresh = compressor.run(recipe_for(source, tmp_path / "fresh", "allocate", confirm_fraction=0.5))
    assert outcome(got) == outcome(fresh)
