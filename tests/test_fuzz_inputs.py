"""A seeded, time-bounded fuzz of the input-validation stage.

Mutated recipes, truncated or corrupted model files and broken data files go
through ``compressor validate`` and the early stage of ``compressor run`` (up
to the point where the model would load). Every case must end in exit 0 or 2
(never 1 on bad input), print no traceback, finish within a time limit, keep
memory bounded, and touch no file outside the output.
"""

from __future__ import annotations

import hashlib
import random
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict, write_recipe  # noqa: F401  (isolated is an autouse fixture)

from compressor.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEED = 20261123
CASES = 48
CASE_SECONDS = 20
PEAK_BYTES = 200 << 20
REACHED_LOAD = 99

YAML_BITS = ["&a ", "*a", "[", "]", "{", "}", ": ", "\n", "  ", "- ", "1e-3", "-1", "null", "~", "'", '"', "#",
             "\udcff", "\x00", "9" * 30, "true", "!!python/object:os.system", "<<: *a", "\t", ",", "ä", "ppl_budget"]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and p.name != "stdout"}


def _mutate_text(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.4:
            text = text[:i] + rng.choice(YAML_BITS) + text[i:]
        elif op < 0.7:
            text = text[:i] + text[i + rng.randint(1, 8):]
        elif op < 0.85:
            lines = text.splitlines()
            if lines:
                j = rng.randrange(len(lines))
                lines.insert(j, lines[j])
            text = "\n".join(lines)
        else:
            text = text[:i] + rng.choice(YAML_BITS) * rng.randint(2, 40) + text[i:]
    return text


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.5:
        return data[: rng.randrange(max(1, len(data)))]
    b = bytearray(data)
    for _ in range(rng.randint(1, 16)):
        i = rng.randrange(min(len(b), 4096)) if rng.random() < 0.8 else rng.randrange(len(b))
        b[i] = rng.randrange(256)
    return bytes(b)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "in", "llama")


def _case(rng: random.Random, root: Path, pristine: Path) -> list[str]:
    model = root / "model"
    model.mkdir()
    for f in pristine.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    data = root / "data.txt"
    data.write_text("alpha beta gamma delta\n" * 400)
    d = recipe_dict(model, root / "out")
    d["calibration"]["dataset"] = str(data)
    text = yaml.safe_dump(d, sort_keys=False)
    target = rng.choice(["recipe", "recipe", "model", "data"])
    if target == "recipe":
        text = _mutate_text(rng, text)
    elif target == "model":
        name = rng.choice(["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
        (model / name).write_bytes(_mutate_bytes(rng, (model / name).read_bytes()))
    else:
        data.write_bytes(_mutate_bytes(rng, data.read_bytes()) if rng.random() < 0.7 else bytes(rng.randrange(256)
                                                                                              for _ in range(500)))
    recipe = root / "recipe.yaml"
    recipe.write_text(text, encoding="utf-8", errors="surrogateescape")
    return [rng.choice(["validate", "run"]), str(recipe)]


def test_fuzzed_inputs_end_in_exit_0_or_2_without_traceback(tmp_path, capsys, monkeypatch, pristine):
    import compressor.pipeline.stages as stages

    def reached(*a, **k):
        raise SystemExit(REACHED_LOAD)

    monkeypatch.setattr(stages, "load_model", reached)
    rng = random.Random(SEED)
    seen = {}
    for n in range(CASES):
        root = tmp_path / f"case{n}"
        root.mkdir()
        argv = _case(rng, root, pristine)
        before = _tree(root)
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        err = capsys.readouterr().err
        seen[rc] = seen.get(rc, 0) + 1
        context = f"case {n}: {argv} → exit {rc}\n{err[-2000:]}"
        assert rc in (0, 2, REACHED_LOAD), context
        assert "Traceback" not in err, context
        assert elapsed < CASE_SECONDS, context
        assert peak < PEAK_BYTES, context
        after = _tree(root)
        touched = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert all(k.startswith(("out", ".out")) for k in touched), (touched, context)
    assert seen.get(2, 0) > CASES // 4, seen  # the mutations do break things
