"""The stock-vs-MoK comparison harness (scripts/compare.py): models.py builds the model,
harness.py trains it, report.py writes the table, JSON, Markdown and plot."""

from mok_plugin.compare.harness import run_comparison
from mok_plugin.compare.report import format_table, write_reports

__all__ = ["format_table", "run_comparison", "write_reports"]
