"""Checkpoints: the layout, writing them atomically, checking them, loading them, merging LoRA.

Nothing outside this package spells a checkpoint file name; it asks :mod:`~llmtrain.checkpoint.layout`.
This ``__init__`` imports nothing, so that reading the layout (the tokenizer and prompt files do)
never pulls in torch. Import what you need from its module:

``layout``        every file and folder name (model.safetensors, checkpoint.json, step-NNNNNNNN, final/, ...),
                  ``step_dir_name``, ``is_complete``, ``list_checkpoints``, ``latest_checkpoint``
``files``         atomic writes: ``write_model_dir``, ``link_model_dir``, ``write_marker`` (the one marker writer;
                  it records every file's size and checksum), ``read_marker``, ``remove_leftovers``,
                  ``prune_checkpoints``
``state``         the training-state schema: ``build_training_state``, ``restore_training_state``,
                  ``load_training_state`` (weights_only; damage raises ``DamagedCheckpointError``), RNG capture
``resume``        ``verify_checkpoint`` (sizes, safetensors headers, DCP index and items, training state),
                  ``verify_checksums``,
                  ``resolve_resume`` (newest intact checkpoint), ``checkpoint_format``
``checkpointer``  ``Checkpointer`` (full, sharded/DCP, LoRA formats; ``save``, ``wait``, ``save_final``, ``resume``,
                  ``load``),
                  ``build_checkpointer``, ``NonFiniteWeightsError``
``dcp_reader``    ``load`` (every DCP load: no pickle in .metadata or non-tensor items runs), ``read_metadata``,
                  ``check_dcp_files``
``weights``       ``load_weights`` (a model directory into a plain, LoRA, DDP or FSDP model),
                  ``gather_full_model_state``, ``load_full_model_state``
``lora``          ``merged_state_dict`` (the one LoRA merge, layer by layer onto the CPU), LoRA settings files
``size``          ``checkpoint_bytes`` (the one size estimate), ``check_disk_space``

Opening a model directory (model, tokenizer, prompt style) and merging a LoRA checkpoint into its base model
directory is :mod:`llmtrain.model_dir`, above the tokenizer and prompts that read this layout.
"""
