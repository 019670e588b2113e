"""The state folder of one run: :class:`RunState` (open, check, record, read back) and :class:`WalkRecords`.

The folder is ``<parent>/.<name>.compressor-state/`` beside the output ``<parent>/<name>``: on the output's file
system (``os.replace`` makes each record atomic), outside the output (its safety rules never see it). What it holds
and why: docs/resume.md. The key it is checked against is :mod:`compressor.engine.runkey`, the records'
encoding :mod:`compressor.engine.records`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from compressor.core.distributed import is_main
from compressor.engine.records import ResumeError, decode, encode
from compressor.engine.runkey import KEY_LABELS, describe_change

# The name the run's log lines have always carried (the CLI prints it).
logger = logging.getLogger(__name__)

STATE_FORMAT = "compressor.run-state/v1"
STATE_FILE = "state.json"
SUFFIX = ".safetensors"
#: Name prefix of the records the gate makes (see :meth:`RunState.begin_gate`).
GATE_PREFIX = "gate-"


def state_dir(output: str | Path) -> Path:
    """The run-state folder of an output folder (see :mod:`compressor.engine.runstate`)."""
    out = Path(output).expanduser().resolve()
    return out.parent / f".{out.name}.compressor-state"


_NAME = re.compile(r"^[a-z0-9-]+$")


class RunState:
    """Checkpoints of one run (see :mod:`compressor.engine.runstate`); ``RunState()`` records nothing."""

    def __init__(self, folder: Path | None = None, key: dict | None = None, *, resumed: bool = False) -> None:
        self.folder = folder
        self.key = dict(key or {})
        self.resumed = resumed
        self._walks = 0
        self._evals = 0
        self._gate = False

    # -- opening ------------------------------------------------------------
    @classmethod
    def open(cls, output: str | Path, key: dict, *, resume: bool,
             reads: Iterable[tuple[str, str | Path]] = (),
             measurements_from: str | Path | None = None) -> "RunState":
        """The state of the run writing ``output``: the saved one (``resume``; checked
        against ``key``) or a fresh one (an earlier state for that output is discarded).
        ``measurements_from``: a fresh state that starts with the measurement records of the
        state kept for that other output (its key must match but for the gate settings)."""
        folder = state_dir(output)
        for what, path in reads:
            p = Path(path).expanduser().resolve()
            if p == folder or p.is_relative_to(folder):
                raise ResumeError(f"{what} ({p}) lies in {folder}, where this run keeps its resume state and which "
                                  "it deletes when it ends; move it elsewhere")
        if measurements_from is not None:
            if resume:
                raise ResumeError("--resume and --measurements-from both name a saved state to start from; use "
                                  "--resume to continue this output's own run, --measurements-from to start a new "
                                  "one from another run's measurements")
            return cls._from_measurements(folder, state_dir(measurements_from), key)
        saved = cls._read_state(folder)
        if not resume:
            if saved is not None and is_main():
                logger.info("discarding the saved state of an earlier interrupted run at %s (run with --resume to "
                            "continue it instead)", folder)
                shutil.rmtree(folder)
            return cls(folder, key)
        if saved is None:
            raise ResumeError(f"--resume: there is no saved run state for output {Path(output).expanduser().resolve()} "
                              f"(looked for {folder / STATE_FILE}); nothing to resume. Run without --resume to start "
                              "a fresh run.")
        state = cls(folder, saved.get("key", {}), resumed=True)
        state._compare(key)
        if is_main():  # temporary folders of the interrupted run (the output lock says it is gone)
            for p in folder.iterdir():
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
        n = sum(1 for p in folder.iterdir() if p.suffix == SUFFIX)
        logger.info("resuming from %s: %d step(s) recorded by the interrupted run", folder, n)
        return state

    @staticmethod
    def _read_state(folder: Path) -> dict | None:
        if not folder.exists():
            return None
        try:
            saved = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved.get("format") == STATE_FORMAT:
            return saved
        if folder.is_dir() and not any(folder.iterdir()):
            return None
        raise ResumeError(f"{folder} exists but is not a compressor run state (no readable {STATE_FILE} of format "
                          f"{STATE_FORMAT}); this run keeps its resume state there. Remove it or choose another "
                          "output folder")

    @classmethod
    def _from_measurements(cls, folder: Path, source: Path, key: dict) -> "RunState":
        saved = cls._read_state(source)
        if saved is None:
            raise ResumeError(f"--measurements-from: there is no kept run state at {source}; run the earlier recipe "
                              "with --keep-state to keep its measurements when it ends")
        if source == folder:
            raise ResumeError("--measurements-from names this run's own output; use --resume to continue it")
        donor = cls(source, saved.get("key", {}), resumed=True)
        donor._compare({k: v for k, v in key.items() if k != "recipe"}, what="--measurements-from")
        own_key = {**donor.key, "recipe": key["recipe"]}
        if not is_main():  # rank 0 links the records; every rank reads them
            return cls(folder, own_key, resumed=True)
        if folder.exists():
            if cls._read_state(folder) is not None:
                logger.info("discarding the saved state of an earlier interrupted run at %s", folder)
            shutil.rmtree(folder)
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        taken = 0
        try:
            for p in sorted(source.iterdir()):
                if p.suffix != SUFFIX or p.name.startswith(GATE_PREFIX) or p.name.startswith("."):
                    continue
                try:
                    os.link(p, tmp / p.name)
                except OSError:
                    shutil.copy2(p, tmp / p.name)
                taken += 1
            state = cls(tmp, own_key, resumed=True)
            state._write_key()
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("measurements from %s: %d record(s) (statistics, loss gradients, baseline) taken; the gate "
                    "runs afresh", source, taken)
        return cls(folder, own_key, resumed=True)

    def _write_key(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        blob = {"format": STATE_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "key": self.key}
        self._atomic(self.folder / STATE_FILE, lambda tmp: tmp.write_text(json.dumps(blob, indent=2) + "\n"))

    def _gate_changed(self, key: dict, differ: list[str]) -> bool:
        """Only the gate settings differ from the saved run: keep the measurements, drop the gate's records."""
        if differ != ["recipe"] or "measurement" not in key or self.key.get("measurement") != key["measurement"]:
            return False
        dropped = 0
        if is_main():
            for p in self.folder.iterdir():
                if p.name.startswith(GATE_PREFIX) and p.suffix == SUFFIX:
                    p.unlink()
                    dropped += 1
            self.key["recipe"] = key["recipe"]
            self._write_key()
        logger.info("--resume: only the gate settings (policy budget, ffn_keep, …) differ from the saved run: its "
                    "measurements are kept and the gate runs afresh (%d gate record(s) dropped)", dropped)
        return True

    def _compare(self, key: dict, what: str = "--resume") -> None:
        if "measurement" in key and "measurement" not in self.key and self.key.get("recipe") == key.get("recipe"):
            # saved by a version before the measurement key: the same recipe is the same measurements
            self.key["measurement"] = key["measurement"]
            if is_main() and self.folder is not None:
                self._write_key()
        if "widths" in key and "widths" not in self.key:
            # saved by a version before the width key: the walk's step names still tell a mismatch
            self.key["widths"] = key["widths"]
        differ = [k for k in key if self.key.get(k) != key[k]]
        if not differ or (what == "--resume" and self._gate_changed(key, differ)):
            return
        if "measurement" in differ and "recipe" in differ:
            differ.remove("recipe")  # the measurement settings say more
        names = [KEY_LABELS.get(k, k) for k in differ]
        names_ = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        detail = "; ".join(describe_change(k, self.key.get(k), key[k]) for k in differ)
        if what != "--resume":
            raise ResumeError(f"{what}: the run state at {self.folder} is of a different {names_} than this run "
                              f"({detail}); measurements are taken only from a run of the same model, data and "
                              "measurement settings (only the policy's gate settings may differ).")
        raise ResumeError(f"--resume: the saved run state at {self.folder} is of a different {names_} than this run "
                          f"({detail}). Run without --resume to start over (the saved state is then discarded), or "
                          "restore the inputs of the interrupted run.")

    def bind_calibration(self, fingerprint: str) -> None:
        """Complete the key with the calibration data: checked when resuming, written otherwise."""
        if self.folder is None:
            return
        if self.resumed:
            self._compare({"calibration": fingerprint})
            return
        self.key["calibration"] = fingerprint
        if not is_main():  # under a process group rank 0 alone writes (every rank's records are equal)
            return
        self._write_key()

    def discard(self) -> None:
        """Delete the state (the run ended: published, or refused by the gate)."""
        if self.folder is not None and self.folder.is_dir() and is_main():
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- records ------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.folder is not None and (self.folder / STATE_FILE).is_file()

    def _atomic(self, path: Path, write: Callable[[Path], None]) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def put(self, name: str, what: str, value: Any) -> None:
        """Record ``value`` as step ``name`` (``what``: a description checked on reading)."""
        if not self.enabled or not is_main():
            return
        from safetensors.torch import save_file

        assert _NAME.match(name), name
        data, tensors = encode(value)
        meta = {"record": json.dumps({"what": what, "value": data})}
        self._atomic(self.folder / f"{name}{SUFFIX}", lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    def get(self, name: str, what: str) -> tuple[bool, Any]:
        """``(True, value)`` when step ``name`` was recorded by the run this one resumes, else ``(False, None)``."""
        if not self.resumed:
            return False, None
        return self.read(name, what)

    def read(self, name: str, what: str) -> tuple[bool, Any]:
        """``(True, value)`` when step ``name`` is on disk (recorded by this run or the one it resumes)."""
        if not self.enabled:
            return False, None
        path = self.folder / f"{name}{SUFFIX}"
        if not path.is_file():
            return False, None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                rec = json.loads((f.metadata() or {})["record"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - an unreadable record is redone, never fatal
            logger.warning("ignoring unreadable run-state record %s (%s); redoing that step", path, e)
            return False, None
        if rec.get("what") != what:
            raise ResumeError(f"--resume: the saved run state at {self.folder} is out of step with this run: its "
                              f"step {name} was {rec.get('what')!r}, this run's is {what!r}. Run without --resume "
                              "to start over.")
        return True, decode(rec["value"], tensors)

    def once(self, name: str, what: str, compute: Callable[[], Any]) -> Any:
        """The recorded result of step ``name``, or ``compute()`` (then recorded)."""
        found, value = self.get(name, what)
        if found:
            logger.info("resume: %s taken from the saved run state", what)
            return value
        value = compute()
        self.put(name, what, value)
        return value

    def recorded(self) -> dict:
        """What a resumed state already holds of the measurements, for the run's time estimate:
        ``{"gradients": bool, "layers": n}`` (loss-gradient statistics; layers of the first walk)."""
        if not (self.resumed and self.enabled):
            return {"gradients": False, "layers": 0}
        names = {p.name for p in self.folder.iterdir()}
        return {"gradients": f"sensitivity{SUFFIX}" in names,
                "layers": sum(1 for n in names if n.startswith("walk01-layer") and n.endswith(SUFFIX))}

    def scratch_folder(self) -> Path | None:
        """Where this run's temporary files go (inside the state folder, so they go with it; a
        killed run's are cleared when the next run of the output opens the state), or None."""
        return self.folder if self.enabled else None

    def begin_gate(self) -> None:
        """The measurements are done: the records from here on depend on the gate settings too
        (named ``gate-…``, dropped when a resumed run changes only those settings)."""
        self._gate = True

    def _scoped(self, name: str) -> str:
        return GATE_PREFIX + name if self._gate else name

    def evaluation(self, desc: str, compute: Callable[[], Any]) -> Any:
        """The next gate evaluation of the run (recorded ones are not run again)."""
        self._evals += 1
        return self.once(self._scoped(f"eval{self._evals:04d}"), desc, compute)

    def walk(self, desc: str) -> "WalkRecords":
        """The records of the next layer walk of the run."""
        self._walks += 1
        return WalkRecords(self, self._scoped(f"walk{self._walks:02d}"), desc)


class WalkRecords:
    """Per-layer records of one layer walk."""

    def __init__(self, state: RunState, prefix: str, desc: str) -> None:
        self.state, self.prefix, self.desc = state, prefix, desc
        self.done: set[int] = set()
        if state.resumed and state.enabled:
            pat = re.compile(rf"^{prefix}-layer(\d+){re.escape(SUFFIX)}$")
            self.done = {int(m[1]) for p in state.folder.iterdir() if (m := pat.match(p.name))}

    def _name(self, i: int) -> str:
        return f"{self.prefix}-layer{i:04d}"

    def save(self, i: int, value: Any) -> None:
        self.state.put(self._name(i), f"{self.desc}: layer {i}", value)

    @property
    def on_disk(self) -> bool:
        """Whether this process's records are on disk to be read back (rank 0 alone writes them)."""
        return self.state.enabled and is_main()

    def load(self, i: int) -> Any:
        found, value = self.state.read(self._name(i), f"{self.desc}: layer {i}")
        if not found:
            raise ResumeError(f"--resume: the record of layer {i} ({self.desc}) in {self.state.folder} could not be "
                              "read. Run without --resume to start over.")
        return value
