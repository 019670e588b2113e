"""Views for people and pipelines: report.json (report), Markdown (markdown), plots (plot) and the model card
(card), all importable from render."""
