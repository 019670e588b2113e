"""``report.json``, typed: :class:`Report` validates a run's report and speaks for it.

    >>> import json                                                       # doctest: +SKIP
    >>> report = Report.of(json.loads(open("out/report.json").read()))    # doctest: +SKIP
    >>> for line in report.summary_lines(): print(line)                  # doctest: +SKIP

Its keys and their types are :class:`~compressor.reports.sections.ReportFields` (``docs/report.schema.json``
is :meth:`Report.model_json_schema`); ``schema_version`` (:data:`SCHEMA_VERSION`) says which keys a pipeline
can rely on. The pipeline stamps it where the report is made and validates the report before writing it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from compressor.reports.sections import REPORT_SCHEMA, SCHEMA_VERSION, ReportFields

#: Where the JSON Schema of report.json is kept (a test checks it is current).
SCHEMA_FILE = Path("docs") / "report.schema.json"


class Report(ReportFields):
    """A run's report, validated: the keys of ``report.json`` typed, with its views as methods."""

    @classmethod
    def of(cls, data: dict) -> Report:
        """``data`` (a report.json's content) validated; :class:`ValueError` naming every key that is wrong."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"the report does not match report.json's schema (version {SCHEMA_VERSION}, "
                             f"{SCHEMA_FILE}): {e}") from None

    def summary_lines(self, output: Path | None = None) -> list[str]:
        """What ``compressor run`` prints when the run ends; ``output``: the folder it was published in."""
        from compressor.reports.summary import summary_lines

        return summary_lines(self, None if output is None else Path(output))

    def card(self) -> str:
        """The model card (``README.md``)."""
        from compressor.reports.card import model_card

        return model_card(self)

    @classmethod
    def json_schema_text(cls) -> str:
        """The JSON Schema of report.json as :data:`SCHEMA_FILE` holds it."""
        return json.dumps(cls.model_json_schema(), indent=2, ensure_ascii=False) + "\n"


__all__ = ["REPORT_SCHEMA", "SCHEMA_FILE", "SCHEMA_VERSION", "Report"]
