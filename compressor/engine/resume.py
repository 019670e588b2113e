"""Resume an interrupted run: checkpoints of every finished step, keyed by what the run depends on.

Where the state lives: ``<parent>/.<name>.compressor-state/`` beside the
output folder ``<parent>/<name>`` (:func:`state_dir`). It depends only on the
resolved output path, so ``--resume`` finds it from the same recipe; it sits on
the output's file system, so ``os.replace`` makes every record atomic; it is
outside the output folder, so the output's safety rules (empty folder or an
earlier compressor output, :mod:`compressor.inputs.safety`) never see it, and its name
does not match the ``.<name>.tmp-<pid>`` leftovers those rules clean. It is not
something the run reads from the user: a run refuses to start when one of its
inputs lies inside it (the folder is deleted when the run ends). The statistics
cache was the other candidate; it is evicted by size and shared by runs, and
the state of one run is neither.

What is in it:

* ``state.json``: the run's key (:func:`run_key`): the model's source files
  (path, name, size and mtime of each weight/config file, sha256 of
  ``config.json``: cheap, and safe when the model is offloaded), the
  calibration and evaluation token fingerprints, the recipe's sha256 (without
  its ``output`` section), the sha256 of its measurement settings (the recipe
  without the policy's gate settings, :data:`~compressor.recipe.schema.GATE_FIELDS`)
  and the tool version. ``--resume`` refuses a state whose key differs, naming
  what differs — except when only the gate settings changed: then the
  measurements are kept and the gate's records are dropped (see below).
* one record per finished step, ``<name>.safetensors`` (tensors + the rest as
  JSON in the metadata; written to a temporary file, then ``os.replace``):
  ``walkNN-layerIIII`` for each layer of each layer walk (what the layer's step
  produced: profile, fit, error curve, kept statistics), ``sensitivity``,
  ``baseline`` (the teacher caches of the evaluation domains) and ``evalNNNN``
  for each gate evaluation, in the order the run makes them. Records made after
  :meth:`RunState.begin_gate` (the gate's evaluations and its calibration passes)
  are named ``gate-…``.

Measurements and the gate: pass A, the loss-gradient pass and the baseline
evaluation depend on the model, the data and the measurement settings; only the
records after :meth:`RunState.begin_gate` depend on the budget. So a run whose
recipe differs from the saved one only in its gate settings (``policy.ppl_budget``,
``ffn_keep``, …) resumes from the measurements and runs its gate afresh — with
``--resume`` on the same output, or with ``--measurements-from`` from the state an
earlier run kept (``--keep-state``) for another output, whose measurement records
are linked (hard links where the file system allows, else copied) into this
run's state. That is how one pass A serves several budgets.

A resumed run repeats every deterministic step (installing fits, rolling
back, bisecting) and takes recorded results instead of measuring or
evaluating again; hidden states are recomputed by forwarding through the
finished layers, so the result is bitwise that of an uninterrupted run on the
same machine and thread count.

>>> state = RunState.open(out, run_key(recipe, src, streams), resume=True)   # doctest: +SKIP
>>> state.bind_calibration(cal.fingerprint())                                # doctest: +SKIP

Where things are: :mod:`compressor.engine.runstate` (:class:`RunState`,
:class:`WalkRecords`, :func:`state_dir` and the folder's file names),
:mod:`compressor.engine.runkey` (:func:`run_key` and what goes into it,
:func:`sha256_file`, :func:`model_identity`, :func:`tokens_fingerprint`) and
:mod:`compressor.engine.records` (:func:`encode`, :func:`decode`,
:func:`register_record`, :class:`ResumeError`). This module re-exports them
all under their old names.
"""

from __future__ import annotations

from compressor.engine.records import ResumeError, decode, encode, register_record
from compressor.engine.runkey import (
    KEY_LABELS, MODEL_FILE_SUFFIXES, model_identity, run_key, sha256_file, tokens_fingerprint,
)
from compressor.engine.runstate import GATE_PREFIX, STATE_FILE, STATE_FORMAT, SUFFIX, RunState, WalkRecords, state_dir

__all__ = [
    "GATE_PREFIX", "KEY_LABELS", "MODEL_FILE_SUFFIXES", "STATE_FILE", "STATE_FORMAT", "SUFFIX", "ResumeError",
    "RunState", "WalkRecords", "decode", "encode", "model_identity", "register_record", "run_key", "sha256_file",
    "state_dir", "tokens_fingerprint",
]
