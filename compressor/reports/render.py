"""Human-readable views: Markdown tables, the per-block plot, the model card.

Where things are (this module re-exports them all under their old names):

* :mod:`compressor.reports.markdown`: the profile and decision tables
  (:func:`profile_table`, :func:`profile_markdown`, :func:`decisions_table`,
  :data:`FLAG`) and the card's sections (:func:`evaluation_section`,
  :func:`confirmation_section`, :func:`agreement_line`, :func:`tasks_section`),
  with the names a card may show (:func:`public_name`, :func:`scrub_paths`);
* :mod:`compressor.reports.plot`: the per-block figure (:func:`profile_figure`,
  :func:`profile_plot`, :data:`BULK_FLOOR`);
* :mod:`compressor.reports.card`: the model card (:func:`model_card`,
  :func:`card_metadata`, :func:`planned_check`).
"""

from __future__ import annotations

from compressor.reports.card import card_metadata, model_card, planned_check
from compressor.reports.markdown import (
    FLAG, agreement_line, confirmation_section, decisions_table, evaluation_section, profile_markdown, profile_table,
    public_name, scrub_paths, tasks_section,
)
from compressor.reports.plot import BULK_FLOOR, profile_figure, profile_plot

__all__ = [
    "BULK_FLOOR", "FLAG", "agreement_line", "card_metadata", "confirmation_section", "decisions_table",
    "evaluation_section", "model_card", "planned_check", "profile_figure", "profile_markdown", "profile_plot",
    "profile_table", "public_name", "scrub_paths", "tasks_section",
]
