"""The smallest report.json that validates (:class:`compressor.reports.schema.Report`), for tests of its views.

``minimal_report(**sections)`` lays each given section over it, dict into dict: a test names only what its
lines read, and the rest is a plausible run of a tiny model.
"""

from __future__ import annotations

import copy

from compressor.reports.schema import REPORT_SCHEMA, SCHEMA_VERSION

_SCORE = {"ppl": 10.0, "nll": 2.302585, "tokens": 8192, "seq_len": 256, "stride": 256, "windows": 32}

BASE = {
    "schema_version": SCHEMA_VERSION, "schema": REPORT_SCHEMA, "tool_version": "0.0.0", "status": "success",
    "exit_code": 0, "message": "ok", "output": "out",
    "model": {"source": "m", "resolved": "m", "model_type": "llama", "dtype": "float32", "device": "cpu"},
    "recipe_sha256": "0" * 64, "recipe": {"replacement": {"kind": "affine"}, "output": {"formats": ["hf"]}},
    "calibration": {"data": "embedded", "seq_len": 256, "fit_windows": 8, "heldout_windows": 2, "tokens": 2560},
    "cache": {"enabled": False, "hit": False, "key": None},
    "perplexity": {"data": "embedded", "baseline": _SCORE, "final": _SCORE, "budget": 10.5, "ppl_budget": 0.05,
                   "budget_mode": "relative", "delta": 0.0, "relative_delta": 0.0},
    "params": {"before": 100, "after": 100, "removed": 0, "ratio": 1.0},
    "strategy": "greedy", "allocation_attempts": [], "blocks": [], "profile": [], "timings": {}, "resumed": False,
    "snapped": {},
    "evaluation": {"confidence": 0.9, "metric": "ppl", "passed": True, "message": "ok", "domains": [],
                   "ppl_budget": 0.05, "budget_mode": "relative"},
    "size": {"source_bytes": 2000, "output_bytes": 1000, "output_dtype": "float32", "output_dtype_is_source": True},
    "agreement": {"next_token": None},
}


def _over(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _over(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def minimal_report(**sections) -> dict:
    """:data:`BASE` with ``sections`` laid over it (a dict into the dict it replaces, key by key)."""
    return _over(copy.deepcopy(BASE), copy.deepcopy(sections))


def checked_report(data: dict):
    """A real run's report validated: the current ``schema_version``, and no top-level key the schema lacks (a new
    key goes into :class:`~compressor.reports.sections.ReportFields` and ``docs/report.schema.json``)."""
    from compressor.reports.schema import Report

    report = Report.of(data)
    assert report.schema_version == SCHEMA_VERSION and report.schema_id == REPORT_SCHEMA
    assert not report.model_extra, f"keys report.json's schema does not name: {sorted(report.model_extra)}"
    return report
