"""What a run will need before it runs: memory per device, checkpoint size, time; and ``--dry_run``.

Everything here is arithmetic on a :class:`~llmtrain.config.Config` and the run's flags. Nothing builds a model,
spawns a process or touches the data, so a plan for 8 GPUs × 4 nodes prints on a laptop.

- :mod:`llmtrain.plan.memory`: the memory model, bytes per device at a training step's peak, by quantity.
- :mod:`llmtrain.plan.communication`: what a tensor or pipeline split costs besides memory (bubble, traffic).
- :mod:`llmtrain.plan.search`: whether the run fits its devices, and which flags and split would.
- :mod:`llmtrain.plan.report`: the ``--dry_run`` report that prints all of it.

The flags (``--dry_run.*``) are :class:`llmtrain.args.DryRunArgs`. Import each name from the module that holds it:
this package re-exports nothing.
"""
