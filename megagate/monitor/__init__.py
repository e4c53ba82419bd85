"""Live monitoring inside a training run: `spike` (the pure loss/grad-norm spike detector), `faults` (injected
faults for testing the monitor), `diagnostics` (gate scores, F-Attn, M-Act from hooks on a model), `events` (the
monitor's event log), `settings` (the typed `monitor:` config section) and `runfiles` (the run-directory schema:
metrics.jsonl, events.jsonl, summary.json). Offline analysis of finished runs is `megagate.analysis`."""
