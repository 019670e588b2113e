"""Views for people and pipelines: report.json (report), Markdown, plots and the model card (render)."""
