"""Offline analysis of models and finished runs: `analyze` (per-layer diagnostics of a model on a text sample:
table and plots, `megagate analyze`), `report` (run directories aggregated into tables and plots, `megagate
report`), `aggregate` (runs grouped by sweep, setting, variant and LR, seeds aggregated; curve spikes judged
offline), `replay` (the spike monitor re-run over a logged curve with other settings), `report_plots` and
`plotting` (matplotlib on Agg, atomic PNGs)."""
