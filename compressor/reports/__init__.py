"""Views for people and pipelines: report.json built (report) and typed (schema, sections), what a run prints
(summary), Markdown (markdown), plots (plot) and the model card (card), each format's words for them (wording)."""
