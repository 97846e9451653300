"""Retrieval benchmark: does the right context stay resident? (`kvflash bench niah`, `kvflash bench ruler`)

filler   haystack text made here (no downloads), deterministic by seed
cases    Case, prompt rendering (chat template or plain), fitting to a token length, JSONL user cases
tasks    passkey, NIAH, multi-key / multi-value / multi-query needles, variable tracking, common words
scoring  free greedy generation (answer found) and teacher forcing (answer tokens that are the argmax)
grid     lengths x pools x policies + the full-cache control: table, JSON, plot
cli      the shared command line
"""
from .cases import Case, Renderer, load_jsonl
from .grid import Config, format_table, make_configs, run_grid, write_json, write_plot
from .scoring import CaseResult, run_case
from .tasks import NIAH_TASKS, RULER_TASKS, TASKS, generate

__all__ = ["Case", "CaseResult", "Config", "NIAH_TASKS", "RULER_TASKS", "Renderer", "TASKS", "format_table",
           "generate", "load_jsonl", "make_configs", "run_case", "run_grid", "write_json", "write_plot"]
