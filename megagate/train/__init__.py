"""The trainer (`megagate train`): `components` (the parts of a run from its RunSetup: model chunks through
megagate.model_factory, DDP, optimizer, scheduler, data), `trainer` (the loop), `callbacks/` (everything around
it), `resume` (what a resume keeps and may change), `metric_writer` (TensorBoard, metrics.jsonl, console line),
`runlock` (one run per directory), `signals` (stop requests).
Checkpoints are megagate.checkpoint's."""
