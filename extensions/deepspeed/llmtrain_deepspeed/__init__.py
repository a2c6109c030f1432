"""DeepSpeed ZeRO for llmtrain: ``--strategy deepspeed_stage_1 | _2 | _2_offload | _3 | _3_offload`` or ``deepspeed``.

The extension ships with llmtrain; the ``deepspeed`` package it drives comes with the optional extra
(``pip install 'llmtrain[deepspeed]'``). llmtrain's core never imports deepspeed: it reads the parallel plan,
and where the plan's wrapper is ``deepspeed`` (or a ``--deepspeed.config`` file is given) the recipes' one entry
point, :func:`llmtrain.recipes.engine.engine`, returns :class:`llmtrain_deepspeed.recipe.DeepSpeedEngine`, the
:class:`llmtrain.recipes.engine.Engine` that answers for DeepSpeed with four things, each behind the interface
the core already has for torch's own engine:

- :func:`llmtrain_deepspeed.config.build_config`: the DeepSpeed config, from llmtrain's flags and the user's
  ``--deepspeed.config`` file, checked before any worker starts (pure Python, no deepspeed import);
- :func:`llmtrain_deepspeed.engine.initialize`: the engine around the built model and optimizer, and
  :class:`llmtrain_deepspeed.engine.DeepSpeedStrategy`, the :class:`llmtrain.train.strategy.Strategy` that lets
  ``fit()`` run its one loop on it;
- :class:`llmtrain_deepspeed.checkpoint.DeepSpeedCheckpointer`: DeepSpeed's sharded files inside llmtrain's
  step directories (same marker, atomic rename, keep_last), resumed at any world size (DeepSpeed's universal
  checkpoint where it differs), and ``final/`` streamed a tensor at a time;
- :func:`llmtrain_deepspeed.build.build_partitioned_model`: under ZeRO stage 3, the model built partitioned
  (``deepspeed.zero.Init``), so that no rank ever holds all of it.
"""
