"""A tiny local lm-evaluation-harness task folder, built from real text that ships with Python.

The text is ``pydoc_data.topics`` (the help topics of the Python documentation, the text ``help()``
shows; Python Software Foundation License). Each item is one sentence of it: the context is the
sentence without its last word, the choices are that word and three last words of other sentences
(a cloze task, scored by lm-eval's ``multiple_choice`` log-likelihood, metric ``acc``). Nothing is
downloaded: the folder holds a JSON-lines file and a task YAML that reads it with the ``json``
builder of ``datasets``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TASK = "pydoc_cloze"


def cloze_items(n: int = 16, seed: int = 0) -> list[dict]:
    from pydoc_data.topics import topics

    sentences = []
    for key in sorted(topics):
        for s in re.split(r"(?<=[.!?])\s+", " ".join(topics[key].split())):
            words = s.rstrip(".!?").split()
            if 6 <= len(words) <= 20 and words[-1].isalpha() and words[-1].islower():
                sentences.append(words)
    rng = random.Random(seed)
    rng.shuffle(sentences)
    picked, enders = sentences[:n], sorted({w[-1] for w in sentences})
    items = []
    for words in picked:
        answer = words[-1]
        others = rng.sample([w for w in enders if w != answer], 3)
        choices = sorted([answer, *others])
        items.append({"context": " ".join(words[:-1]), "choices": choices, "label": choices.index(answer)})
    return items


def write_task_folder(folder: Path, n: int = 16) -> Path:
    """``folder`` with ``pydoc_cloze.jsonl`` and ``pydoc_cloze.yaml`` (task ``pydoc_cloze``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in cloze_items(n)))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return folder
