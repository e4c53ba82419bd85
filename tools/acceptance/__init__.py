"""The GPU acceptance's parts (`tools/gpu_acceptance.py` runs them, each in its own process group).

Made for one GPU machine with python3, torch and CUDA but nothing else of ours: no megatron-core (a carried wheel),
no Transformer Engine, apex or DALI, no network, a few minutes for everything, and only a handful of small files
coming back from its result folder. Modules:

* `runner`   — stdlib only: run one part against its share of the deadline in a new session, kill the whole group
  (and anything carrying the part's marker) when the share is spent, read what the part wrote;
* `report`   — stdlib only: the JSON (rewritten atomically after every part), the capped log and result files, the
  one-line summary;
* `parts`    — stdlib only: each part's command, cap and what it needs, and how its output becomes figures;
* `child`    — the harness of the parts that are Python modules (result file, failure record);
* `install`, `preflight`, `bench`, `plan_part`, `calibrate`, `pytest_progress`, `hang` — the part processes;
* `acceptance.yaml` — the model and run that the benchmark and the training share.
"""
