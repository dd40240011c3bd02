"""The stock-vs-MoK comparison harness (`mok compare`, scripts/compare.py): data.py makes the
synthetic language it trains on, models.py builds the model, harness.py trains it and measures,
report.py writes the table, JSON, Markdown and plot, cli.py is the command, stock_path.py picks the
stock layer (and the grouped_mm stand-in), and stock_cpu.py lets Megatron's stock layer run on the CPU."""

from mok_plugin.compare.harness import run_comparison
from mok_plugin.compare.report import format_table, write_reports

__all__ = ["format_table", "run_comparison", "write_reports"]
