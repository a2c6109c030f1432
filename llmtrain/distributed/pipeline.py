"""Pipeline parallelism: the GPT cut into stages by blocks, run by ``torch.distributed.pipelining``'s schedules.

    stage 0           stage 1          ...   stage S-1
    wte, blocks 0-3   blocks 4-7       ...   blocks .., norm_f, lm_head (and the loss)

Each stage is a :class:`GPTStage`: a module with the GPT's own attribute names (``wte``, ``blocks``,
``norm_f``, ``lm_head``; the parts it does not hold are None) and ``blocks`` an ``nn.ModuleDict`` keyed by
layer index, so its parameter names are the whole model's (``blocks.7.attn.q_proj.weight``) and every
checkpoint reads and writes the same keys whatever the layout. ``parallelize()`` (activation checkpointing,
compile, FSDP over the data-parallel mesh) applies to a stage as to a GPT.

Pipeline rank r holds stage r, and under ``interleaved_1f1b`` also stages r + pp, r + 2 pp, ... . The rank's
stages together are one :class:`PipelineParts`, the module the rest of llmtrain sees (the optimizer, the
checkpointer, gradient clipping, ``materialize``). :class:`Pipeline` runs the schedule: each optimizer step
sends the step's micro-batches (the batch plan's accumulation steps) through the pipeline once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, NamedTuple, Optional

import torch
import torch.nn as nn

from llmtrain.config import Config
from llmtrain.loss import IGNORE_INDEX, head_loss_sum
from llmtrain.model import Block, build_norm, build_rope_cache, build_sliding_window_mask, init_gpt_weights


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The layer indices of each stage: as even as the count allows, the extra layers on the first stages.

    NOTE: the last stage also runs the head and the loss (a vocabulary-wide matmul per token), so it is the
    one that gets no extra layer.
    """
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"{n_stages} pipeline stages for {n_layer} layers: each stage needs at least one layer")
    base, extra = divmod(n_layer, n_stages)
    sizes = [base + (stage < extra) for stage in range(n_stages)]
    starts = [sum(sizes[:stage]) for stage in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def rank_stages(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds: ``pp_rank``, ``pp_rank + pp_size``, ... (looped, as
    torch's interleaved schedules expect)."""
    return [pp_rank + pp_size * loop for loop in range(virtual_stages)]


class GPTStage(nn.Module):
    """Some consecutive blocks of a GPT, with the embedding on the first stage and the final norm and head on
    the last. ``forward`` takes token ids (first stage) or hidden states (B, T, C) and returns hidden states;
    the last stage's are normalised, and the schedule's loss function applies the head."""

    def __init__(self, config: Config, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd) if first else None
        self.blocks = nn.ModuleDict({str(index): Block(config) for index in layers})
        self.norm_f = build_norm(config) if last else None
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias) if last else None
        self.max_seq_length = config.block_size
        cos, sin = build_rope_cache(self.max_seq_length, config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(x)  # (B, T) ids -> (B, T, C)
            if self.config.scale_embeddings:
                x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        T = x.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, rope_n_elem)
        mask = build_sliding_window_mask(T, self.config.sliding_window, x.device)
        for block in self.blocks.values():
            x = block(x, cos, sin, mask)
        return self.norm_f(x) if self.norm_f is not None else x  # (B, T, C)

    def reset_rope_cache(self) -> None:
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = build_rope_cache(self.max_seq_length, self.config, device=device)


class PipelineParts(nn.Module):
    """The stages one pipeline rank holds, seen as one module with the GPT's parameter names.

    ``wte``, ``blocks``, ``norm_f`` and ``lm_head`` are the stages' own modules (shared, not copied), so
    ``parameters()``, ``state_dict()`` and the optimizer cover exactly this rank's part of the model. The stages
    themselves (:attr:`stages`, in stage order) are not submodules, which would name each parameter twice.
    """

    def __init__(self, config: Config, stages: list[GPTStage], stage_indices: list[int], n_stages: int) -> None:
        super().__init__()
        if config.tie_embeddings and n_stages > 1:
            raise ValueError("tied embeddings put one weight on the first and the last pipeline stage")
        self.config = config
        self.stages = stages
        self.stage_indices = stage_indices
        self.n_stages = n_stages
        self.wte = next((stage.wte for stage in stages if stage.wte is not None), None)
        self.blocks = nn.ModuleDict({name: block for stage in stages for name, block in stage.blocks.items()})
        self.norm_f = next((stage.norm_f for stage in stages if stage.norm_f is not None), None)
        self.lm_head = next((stage.lm_head for stage in stages if stage.lm_head is not None), None)
        self.mesh = None  # the run's DeviceMesh, set by build_pipeline_parts

    @property
    def max_seq_length(self) -> int:
        return self.stages[0].max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if not 0 < value <= self.config.block_size:
            raise ValueError(f"max_seq_length {value} must be in [1, block_size {self.config.block_size}] of model "
                             f"{self.config.name!r}; lower --train.max_seq_length")
        for stage in self.stages:
            stage.max_seq_length = value
        self.reset_rope_cache()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The weights the whole GPT would get from the same RNG state (see :func:`init_gpt_weights`)."""
        init_gpt_weights(self, self.config)
        self.reset_rope_cache()

    def reset_rope_cache(self) -> None:
        for stage in self.stages:
            stage.reset_rope_cache()

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank holds part of the model: run it through Pipeline, not model(...)")

    def whole_model(self) -> nn.Module:
        """The whole GPT on the meta device: the names and shapes a full checkpoint holds."""
        from llmtrain.model import GPT

        with torch.device("meta"):
            return GPT(self.config)

    # ---- full state: every stage's part on rank 0, one tensor at a time; collectives, all ranks call them ------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0's CPU (an empty dict elsewhere)."""
        state = self.state_dict()
        parts = self._parts_on_rank0(state, lambda pp_rank: _predicted_weights(self._meta_parts(pp_rank), state))
        return {name: tensor for part in parts for name, tensor in part.items()}

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state of the whole model on rank 0's CPU, keyed by parameter name (as
        ``get_optimizer_state_dict(full_state_dict=True)`` gives it for one model); an empty dict elsewhere."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(self, optimizer)
        parts = self._parts_on_rank0(state, lambda pp_rank: _predicted_optimizer_state(self._meta_parts(pp_rank), state))
        if not parts:
            return {}
        groups = [dict(group, params=[name for part in parts for name in part["param_groups"][index]["params"]])
                  for index, group in enumerate(parts[0]["param_groups"])]
        return {"state": {name: value for part in parts for name, value in part["state"].items()},
                "param_groups": groups}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load this rank's entries of the whole model's optimizer state ``state`` (keyed by parameter name).

        Every rank passes the same ``state``: a full checkpoint's, memory-mapped, so a rank reads from disk only its
        own parameters' tensors, and keeps only its shard of each. Nothing is sent between ranks.
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        parameters = dict(self.named_parameters())
        part = _optimizer_part(state, set(parameters), optimizer)
        part["state"] = {name: {key: _local_shard_of(value, parameters[name]) for key, value in entries.items()}
                         for name, entries in part["state"].items()}
        set_optimizer_state_dict(self, optimizer, part)

    def _parts_on_rank0(self, state: dict, predicted: Callable[[int], dict]) -> list[dict]:
        """Every pipeline rank's ``state`` with its tensors whole, on rank 0's CPU, in pipeline-rank order (an empty
        list elsewhere). Every rank calls it. ``predicted(pp_rank)``: that rank's ``state`` as this rank expects it,
        each tensor replaced by its :class:`_TensorSpec`.

        NOTE: each stage's ranks gather their tensors whole one at a time (a collective over the stage's data- and
        tensor-parallel ranks); the stage's first rank sends each to rank 0 over the pipeline dimension of the mesh,
        and waits until it is received before gathering the next. So rank 0 receives one tensor at a time, one copy
        of each whatever the data-parallel size, and holds one on its device; the alternative, gathering pickled
        stages with gather_object, pads every rank's bytes to the largest and allocates world size times that on
        rank 0's GPU. Rank 0 writes the files only after the last tensor arrived: no collective waits for its disk.

        Rank 0 knows what to receive without being told: the names and shapes follow from the config and the
        layout, and an optimizer's state from its own (:func:`_predicted_optimizer_state`). Where a state does not
        match what is predicted for it (an optimizer whose state is not a tensor like each parameter, or a 0-d one),
        the stage's first rank sends its state's skeleton (names, shapes, numbers; no tensor) first; two flags say
        which. So where the prediction holds, rank 0 reads no value but the flags, and the fake process group of
        ``--dry_run.simulate`` (whose messages carry no values; a flag it reads is 1) runs this path as is.
        """
        import torch.distributed as dist

        pp_mesh = self.mesh["pp"]
        group, pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
        device = _transfer_device(pp_mesh)
        skeleton, tensors = _split_tensors(state)
        sends = self._leads_stage() and pp_rank > 0  # rank 0 leads stage 0
        as_predicted = (sends or dist.get_rank() == 0) and _same_layout(skeleton, predicted(pp_rank))
        if dist.get_rank() == 0:  # the first rank of stage 0 (the mesh's first coordinate everywhere)
            parts = [_with_tensors(skeleton, [_whole(tensor).cpu() for tensor in tensors])]
            for source in range(1, pp_mesh.size()):
                # Whether rank 0 trusts its predictions (its own state is as predicted), and whether the source's is.
                dist.send(torch.tensor([as_predicted], dtype=torch.int64, device=device), group_dst=source, group=group)
                flag = torch.zeros(1, dtype=torch.int64, device=device)
                dist.recv(flag, group_src=source, group=group)
                if as_predicted and flag.item():
                    expected = predicted(source)
                else:
                    box: list = [None]
                    dist.recv_object_list(box, group_src=source, group=group, device=device)
                    expected = box[0]
                received = []
                for _, spec in _tensor_layout(expected):
                    buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                    dist.recv(buffer, group_src=source, group=group)
                    received.append(buffer.cpu())
                parts.append(_with_tensors(expected, received))
            return parts
        if sends:
            trusted = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(trusted, group_src=0, group=group)
            dist.send(torch.tensor([as_predicted], dtype=torch.int64, device=device), group_dst=0, group=group)
            if not (trusted.item() and as_predicted):
                dist.send_object_list([skeleton], group_dst=0, group=group, device=device)
        for tensor in tensors:
            whole = _whole(tensor)  # every rank of the stage takes part
            if sends:
                dist.send(whole.to(device).contiguous(), group_dst=0, group=group)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # received: one tensor in flight, not all
        return []

    def _meta_parts(self, pp_rank: int) -> "PipelineParts":
        """Pipeline rank ``pp_rank``'s stages on the meta device: their parameters' names and whole shapes."""
        virtual_stages = len(self.stage_indices)
        with torch.device("meta"):
            return build_pipeline_parts(self.config, pp_rank=pp_rank, pp_size=self.n_stages // virtual_stages,
                                        virtual_stages=virtual_stages)

    def _leads_stage(self) -> bool:
        """Whether this rank is the first of its stage's ranks (coordinate 0 on every mesh dimension but pp)."""
        coordinate = self.mesh.get_coordinate()
        return all(index == 0 for name, index in zip(self.mesh.mesh_dim_names, coordinate) if name != "pp")

    def _apply(self, fn, recurse=True):
        # NOTE: the stages' RoPE tables are their own buffers, outside this module's tree; move them along
        # (to_empty after the meta device, .to(device)).
        module = super()._apply(fn, recurse)
        for stage in self.stages:
            stage._apply(fn, recurse=False)
        return module


def build_pipeline_parts(config: Config, *, pp_rank: int, pp_size: int, virtual_stages: int) -> PipelineParts:
    """This rank's stages of ``config``'s GPT, on the current device (the meta device, for a recipe)."""
    n_stages = pp_size * virtual_stages
    layers = stage_layers(config.n_layer, n_stages)
    indices = rank_stages(pp_rank, pp_size, virtual_stages)
    stages = [GPTStage(config, layers[index], first=index == 0, last=index == n_stages - 1) for index in indices]
    return PipelineParts(config, stages, indices, n_stages)


def _optimizer_part(state: dict, names: set[str], optimizer: torch.optim.Optimizer) -> dict:
    """The entries of a whole model's optimizer state (keyed by parameter name) for the parameters ``names``.

    NOTE: group entries the fresh optimizer lacks (the schedule's initial_lr) would be refused by
    ``set_optimizer_state_dict``; restore_training_state sets them on every rank afterwards.
    """
    groups = [{**{key: value for key, value in group.items() if key in fresh},
               "params": [name for name in group["params"] if name in names]}
              for group, fresh in zip(state["param_groups"], optimizer.param_groups)]
    return {"state": {name: value for name, value in state["state"].items() if name in names}, "param_groups": groups}


class _TensorSpec(NamedTuple):
    """A tensor's place in a state sent ahead of the tensor itself: what rank 0 needs to receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _split_tensors(state):
    """(``state`` with each tensor replaced by its :class:`_TensorSpec`, the tensors in the order of the specs).

    NOTE: the skeleton holds no tensor, so the object sent ahead of a stage's tensors stays small (names, numbers,
    shapes), whatever the stage's size.
    """
    tensors: list[torch.Tensor] = []

    def strip(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorSpec(tuple(value.shape), value.dtype)  # a DTensor's shape is the whole tensor's
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    return strip(state), tensors


def _tensor_layout(skeleton, path: tuple = ()) -> list[tuple[tuple, _TensorSpec]]:
    """Where each tensor of a skeleton of :func:`_split_tensors` sits (its keys and indices), with its spec, in order."""
    if isinstance(skeleton, _TensorSpec):
        return [(path, skeleton)]
    if isinstance(skeleton, dict):
        return [found for key, item in skeleton.items() for found in _tensor_layout(item, path + (key,))]
    if isinstance(skeleton, (list, tuple)):
        return [found for index, item in enumerate(skeleton) for found in _tensor_layout(item, path + (index,))]
    return []


def _same_layout(skeleton, expected) -> bool:
    """Whether two skeletons hold the same tensors in the same places and order (and an optimizer state's param
    groups the same parameters)."""
    def groups(value) -> Optional[list]:
        return [group.get("params") for group in value.get("param_groups", [])] if isinstance(value, dict) else None

    return _tensor_layout(skeleton) == _tensor_layout(expected) and groups(skeleton) == groups(expected)


def _predicted_weights(parts: "PipelineParts", own: dict) -> dict:
    """The skeleton of the state dict of ``parts`` (another pipeline rank's stages, on the meta device), in the
    dtype of this rank's own state dict ``own``."""
    dtypes = {tensor.dtype for tensor in own.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else None  # several: nothing to predict from (the stage says)
    return {name: _TensorSpec(tuple(tensor.shape), dtype) for name, tensor in parts.state_dict().items()}


def _predicted_optimizer_state(parts: "PipelineParts", own: dict) -> dict:
    """The skeleton of the optimizer state of ``parts`` (another pipeline rank's stages, on the meta device) if it is
    like this rank's ``own``: each parameter's entries those of this rank's first, a tensor shaped like the
    parameter or a 0-d one (AdamW's moments and step), in one param group. An optimizer whose state is not so is told
    apart by comparing its own state with this prediction (:meth:`PipelineParts._parts_on_rank0`)."""
    template = next(iter(own["state"].values()), {})

    def entry(value, shape: tuple[int, ...]):
        if isinstance(value, torch.Tensor):
            return _TensorSpec(shape if value.dim() else (), value.dtype)
        return value

    named = list(parts.named_parameters())
    state = {name: {key: entry(value, tuple(parameter.shape)) for key, value in template.items()}
             for name, parameter in named} if own["state"] else {}
    groups = own["param_groups"][:1]
    return {"state": state, "param_groups": [dict(group, params=[name for name, _ in named]) for group in groups]}


def _with_tensors(skeleton, tensors: list[torch.Tensor]):
    """The inverse of :func:`_split_tensors`: ``skeleton`` with ``tensors`` back in the specs' places."""
    remaining = iter(tensors)

    def fill(value):
        if isinstance(value, _TensorSpec):
            return next(remaining)
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return fill(skeleton)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered over its mesh (a collective of its ranks), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _local_shard_of(value, parameter: torch.Tensor):
    """A whole optimizer-state tensor of ``parameter`` as this rank keeps it: its shard (a DTensor) if the parameter
    is one, else a copy; other values (numbers, the 0-d step) as they are.

    NOTE: ``src_data_rank=None``: every rank has the whole tensor and cuts out its own shard; the default would
    scatter it from the mesh's first rank. The shard is copied: it must not keep the memory-mapped file's pages.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if not isinstance(parameter, DTensor):
        return value.clone()
    shard = distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
    return DTensor.from_local(shard.to_local().clone(), parameter.device_mesh, parameter.placements,
                              shape=shard.shape, stride=shard.stride(), run_check=False)


def _transfer_device(mesh) -> torch.device:
    """The device a tensor goes through to cross ``mesh``'s process groups (NCCL's: this rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def build_pipeline_model(config: Config, *, plan, runtime, seed: int, compile: bool = False,
                         allocating: Callable[[], ContextManager] = contextlib.nullcontext) -> PipelineParts:
    """This rank's stages built on the meta device, each parallelized (checkpointing, compile, FSDP over the
    data-parallel ranks), then materialised (in the ``allocating`` context, see
    :func:`llmtrain.recipes.build.build_model`) with the weights the whole model gets from ``seed``. The stages are
    those of this rank's place on the mesh's ``pp`` dimension, the one the schedule communicates on."""
    from llmtrain.distributed.parallelize import materialize, parallelize

    mesh = runtime.mesh if runtime.mesh is not None else plan.build_mesh()
    with torch.device("meta"):
        parts = build_pipeline_parts(config, pp_rank=plan.coordinates(mesh, runtime.rank)["pp_rank"], pp_size=plan.pp,
                                     virtual_stages=plan.pp_virtual_stages)
    parts.to(plan.precision.param_dtype)
    for stage in parts.stages:
        parallelize(stage, plan, device=runtime.device, compile=compile, mesh=mesh)
    with allocating():
        materialize(parts, runtime.device, seed, cpu_offload=plan.cpu_offload)
    parts.mesh = mesh
    return parts


class Pipeline:
    """Runs a rank's :class:`PipelineParts` through the plan's schedule: one optimizer step's micro-batches at
    a time, and the validation batches forward only.

    The loop hands it the step's micro-batches; they are concatenated (and padded to the model's sequence
    length, so that every step sends activations of one shape), the first stage reads the input ids, the last
    the labels. The loss of each micro-batch is its summed token losses times the step's loss scale, and the
    gradients are not scaled again (``scale_grads=False``), exactly as the loop's own accumulation.
    """

    def __init__(self, parts: PipelineParts, *, schedule: str, n_microbatches: int, micro_batch_size: int,
                 device: torch.device, autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 activation_dtype: Optional[torch.dtype] = None, sequence_parallel: bool = False) -> None:
        """``activation_dtype``: the dtype of the hidden states between stages, which with ``sequence_parallel`` (the
        stream a DTensor split over the sequence on the ``tp`` ranks) fixes every shape the stages exchange; None
        leaves torch to infer them from a first forward and backward, exchanged between the stages at the start."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.parts = parts
        self.n_microbatches = n_microbatches
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.autocast = autocast
        self.pp_mesh = parts.mesh["pp"]
        group = self.pp_mesh.get_group()
        # NOTE: under tensor parallelism with sequence parallelism the activations between stages are DTensors; the
        # receiving stage rebuilds them on its own sub-mesh of the same dimension names (its tp ranks).
        def get_mesh(names: tuple[str, ...], layout) -> object:
            return parts.mesh[names]

        for stage in parts.stages:
            _forward_under(autocast, stage)
        shapes = (lambda index: {}) if activation_dtype is None else functools.partial(
            _stage_shapes, parts, micro_batch_size, activation_dtype,
            sequence_parallel)
        self.stages = [PipelineStage(stage, index, parts.n_stages, device, group=group, get_mesh=get_mesh,
                                     **shapes(index))
                       for stage, index in zip(parts.stages, parts.stage_indices)]
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.head = parts.lm_head
        self.loss_scale: torch.Tensor | float = 1.0
        self.on_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self.token_loss_sums: list[torch.Tensor] = []
        options = dict(n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, **options)
        else:
            single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.schedule = single(self.stages[0], **options)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: summed token losses (fused with the head), scaled."""
        with self.autocast():
            token_loss_sum = head_loss_sum(self.head, hidden, labels)  # () fp32
        self.token_loss_sums.append(token_loss_sum.detach())
        return self.on_loss(token_loss_sum * self.loss_scale)

    def forward_backward(self, micro_batches: list[dict], loss_scale: torch.Tensor,
                         on_loss: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; returns their summed token losses on the last stage's
        ranks (zero elsewhere), not scaled. ``on_loss`` sees each micro-batch's scaled loss (the loop's hook)."""
        self.loss_scale, self.on_loss = loss_scale, on_loss
        try:
            return self._run(micro_batches, train=True)
        finally:
            self.loss_scale, self.on_loss = 1.0, (lambda loss: loss)

    @torch.no_grad()
    def loss_sum(self, batches: list[dict]) -> torch.Tensor:
        """The summed token losses of ``batches`` (forward only), on the last stage's ranks; zero elsewhere.

        They go through the pipeline ``n_microbatches`` at a time; a last group that falls short is filled with
        batches whose every label is ignored, which add nothing.
        """
        total = torch.zeros((), device=self.device)
        for start in range(0, len(batches), self.n_microbatches):
            group = batches[start:start + self.n_microbatches]
            total += self._run(group + [None] * (self.n_microbatches - len(group)), train=False)
        return total

    def _run(self, batches: list[Optional[dict]], *, train: bool) -> torch.Tensor:
        input_ids, labels = self._concatenated(batches)
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        self.token_loss_sums = []
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, return_outputs=False)  # the losses are all the loop wants
        if not self.token_loss_sums:
            return torch.zeros((), device=self.device)
        # NOTE: when the schedule switches between eval and training it infers the stages' shapes again, calling the
        # loss function once on made-up data before the real micro-batches: only the last n losses are theirs.
        return torch.stack(self.token_loss_sums[-self.n_microbatches:]).sum()

    def _concatenated(self, batches: list[Optional[dict]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches' ids and labels, each padded to (micro batch size, sequence length), one after another, on
        the device."""
        # NOTE: pinned on CUDA, so that the copies really run beside the host's work (from pageable memory a
        # non_blocking copy is staged and waits); nothing is pinned for a CPU run, where pinning makes a CUDA context.
        input_ids, labels = concatenated_batches(batches, self.micro_batch_size, self.parts.max_seq_length,
                                                 pin_memory=self.device.type == "cuda")
        return input_ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def concatenated_batches(batches: list[Optional[dict]], rows: int, columns: int, *,
                         pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches' ids and labels in host memory, each padded to (``rows``, ``columns``), one after another; a None
    batch is all padding, with every label ignored.

    NOTE: fresh tensors each step, not buffers kept between steps: torch's pinned-memory cache hands a block out again
    only once the copies from it have finished, which a reused buffer would have to wait for by hand.
    """
    input_ids = torch.zeros(len(batches) * rows, columns, dtype=torch.long, pin_memory=pin_memory)
    labels = torch.full((len(batches) * rows, columns), IGNORE_INDEX, dtype=torch.long, pin_memory=pin_memory)
    for index, batch in enumerate(batches):
        if batch is None:
            continue
        ids, target = batch["input_ids"], batch["labels"]
        if ids.size(0) > rows or ids.size(1) > columns:
            raise ValueError(f"a batch of shape {tuple(ids.shape)} does not fit the pipeline's micro-batches of "
                             f"{rows} sequences of {columns} tokens")
        input_ids[index * rows:index * rows + ids.size(0), :ids.size(1)] = ids
        labels[index * rows:index * rows + ids.size(0), :ids.size(1)] = target
    return input_ids, labels


def _stage_shapes(parts: PipelineParts, micro_batch_size: int, activation_dtype: torch.dtype, sequence_parallel: bool,
                  index: int) -> dict:
    """What stage ``index`` receives and sends, for torch's PipelineStage (its input_args, output_args and, for
    DTensors, their gradients' input_grads and output_grads), as meta tensors.

    NOTE: every micro-batch is padded to (micro batch size, the model's sequence length) (:meth:`Pipeline._concatenated`),
    so each stage's shapes are known before any data: the first stage takes the token ids, every stage sends hidden
    states (B, T, C) in ``activation_dtype``, under sequence parallelism a DTensor ``Shard(1)`` over the ``tp`` ranks.
    Given them, torch's schedules skip the first step's exchange of shapes between the stages (pickled objects sent
    rank to rank), and ``--dry_run.simulate``, whose fake process group delivers nothing, can run a pipeline.
    """
    rows, columns, width = micro_batch_size, parts.max_seq_length, parts.config.n_embd

    def hidden(requires_grad: bool) -> torch.Tensor:
        if not sequence_parallel:
            return torch.empty(rows, columns, width, dtype=activation_dtype, device="meta", requires_grad=requires_grad)
        from torch.distributed.tensor import DTensor, Shard

        tp_mesh = parts.mesh["tp"]
        local = torch.empty(rows, columns // tp_mesh.size(), width, dtype=activation_dtype, device="meta",
                            requires_grad=requires_grad)
        return DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False)

    ids = torch.empty(rows, columns, dtype=torch.long, device="meta")
    shapes = {"input_args": ids if index == 0 else hidden(True), "output_args": hidden(True)}
    if sequence_parallel:  # DTensors: torch asks for the gradients' layouts too (the same as the tensors')
        shapes.update(input_grads=None if index == 0 else hidden(False), output_grads=hidden(False))
    return shapes


def _forward_under(autocast: Callable[[], ContextManager], stage: nn.Module) -> None:
    """Run ``stage``'s forward, and only its forward, under ``autocast``.

    NOTE: the schedule runs forwards and backwards in turn. The loop runs its backward outside autocast; a backward
    inside it would run the backward passes written out (RMSNorm's, the fused loss's) in the autocast dtype, and the
    pipeline's gradients would differ from one process's.
    """
    forward = stage.forward

    def forward_under_autocast(*args, **kwargs):
        with autocast():
            return forward(*args, **kwargs)

    stage.forward = forward_under_autocast


def build_pipeline(parts: PipelineParts, plan, runtime) -> Pipeline:
    """The pipeline of a recipe's run: the plan's schedule over its micro-batches, with the loop's autocast."""
    # The stream between stages is in the compute dtype where FSDP casts the weights (its mixed-precision policy);
    # under autocast it stays in the weights' dtype (the embedding's output, to which each block adds its own).
    activation_dtype = plan.precision.compute_dtype if plan.mixed_precision_policy else plan.precision.param_dtype
    return Pipeline(parts, schedule=plan.pp_schedule, n_microbatches=plan.pp_microbatches,
                    micro_batch_size=plan.batch.micro_batch_size, device=runtime.device,
                    autocast=lambda: plan.precision.autocast(runtime.device, not plan.mixed_precision_policy),
                    activation_dtype=activation_dtype, sequence_parallel=plan.sequence_parallel)
