"""Pipeline parallelism (llmtrain/distributed/pipeline.py) on real gloo process groups, and through the real CLI.

One launch does the multi-process work (pp_worker.py): 4 ranks run pp2 × dp2 (FSDP inside each stage, full
checkpoints), then 2 of them run pp2 with each schedule (one of them writing sharded checkpoints). Each test checks one
claim against a single-process reference that runs the same code in this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pp_worker
from llmtrain.checkpoint import layout
from llmtrain.checkpoint.resume import checkpoint_format
from llmtrain.checkpoint.weights import load_weights
from llmtrain.config import Config
from llmtrain.distributed.parallelize import materialize
from llmtrain.distributed.pipeline import build_pipeline_parts, rank_stages, stage_layers
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from parity import assert_same_training

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@pytest.fixture(scope="module")
def single() -> dict:
    return pp_worker.train(Runtime())


class Launches:
    """The results of pp_worker's suites, from one launch on first use: "four" on 4 ranks, then "two" on the first 2
    in a process group of their own; their files are in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.results = workdir, {}

    def __getitem__(self, suite: str) -> dict:
        if not self.results:
            self.results.update(pp_worker.launch(4, "four+two", self.workdir, timeout_s=600))
        return self.results[suite]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("pipeline"))


def assert_same_validation(result: dict, reference: dict) -> None:
    assert sorted(result["val_losses"]) == [0, 4, 8]
    for step, loss in reference["val_losses"].items():
        assert result["val_losses"][step] == pytest.approx(loss, rel=1e-5), step


# ------------------------------------------------------------------------------------ parity
@pytest.mark.multiproc
@pytest.mark.parametrize("schedule, stages", [("gpipe", [["0", "1"]]), ("1f1b", [["0", "1"]]),
                                              ("interleaved_1f1b", [["0"], ["2"]])])
def test_pp2_matches_one_process_with_each_schedule(launches, single, schedule, stages):
    result = launches["two"][schedule]
    assert result["mesh_shape"] == "pipeline 2" and result["wrapper"] == "none"
    assert result["stages"] == stages  # rank 0's stages: looped for interleaved
    assert_same_training(result, single)
    assert_same_validation(result, single)


@pytest.mark.multiproc
def test_pp2_in_bf16_mixed_matches_one_process(launches):
    """Autocast covers the stages' forwards and the loss, not the backward, as in the loop: under it the backward
    passes written out (RMSNorm's, the fused loss's) would run in bf16, 1e-4 off in the first grad norm."""
    result, reference = launches["two"]["bf16-mixed"], pp_worker.train(Runtime(), precision="bf16-mixed")
    # NOTE: the pipeline sums the squares of the gradient norm in another order (1e-7 apart, as in fp32); after a few
    # AdamW steps bf16's rounding of the weights makes that more: compare the first steps.
    steps = range(1, 5)
    torch.testing.assert_close([result["losses"][step] for step in steps],
                               [reference["losses"][step] for step in steps], rtol=1e-6, atol=0)
    torch.testing.assert_close([result["grad_norms"][step] for step in steps],
                               [reference["grad_norms"][step] for step in steps], rtol=1e-5, atol=0)


@pytest.mark.multiproc
def test_pp2_dp2_shards_each_stage_with_fsdp_and_matches_one_process(launches, single):
    result = launches["four"]["pp2_dp2"]
    assert result["mesh_shape"] == "pipeline 2 × shard 2" and result["wrapper"] == "fsdp"
    assert result["fsdp_units"] == [["blocks.0"], ["blocks.1"], ["wte"]]  # rank 0: stage 0's units
    assert_same_training(result, single)
    assert_same_validation(result, single)


@pytest.mark.multiproc
def test_tp2_pp2_matches_one_process(launches, single):
    result = launches["four"]["tp2_pp2"]
    assert result["mesh_shape"] == "pipeline 2 × tensor 2" and result["stages"] == [["0"], ["2"]]
    assert_same_training(result, single)
    assert_same_validation(result, single)


@pytest.mark.multiproc
def test_stages_start_from_the_one_process_weights_bit_exactly(launches, single):
    four = launches["four"]
    for result in (launches["two"]["1f1b"], launches["two"]["interleaved_1f1b"], four["pp2_dp2"], four["tp2_pp2"]):
        assert result["initial_weights"].keys() == single["initial_weights"].keys()
        for name, tensor in single["initial_weights"].items():
            assert torch.equal(result["initial_weights"][name], tensor), name


def test_stage_init_equals_the_whole_model_init_in_one_process():
    config = pp_worker.pp_config()
    whole = GPT(config)
    materialize(whole, torch.device("cpu"), seed=7)
    expected = whole.state_dict()
    for rank in range(2):
        with torch.device("meta"):
            parts = build_pipeline_parts(config, pp_rank=rank, pp_size=2, virtual_stages=2)
        materialize(parts, torch.device("cpu"), seed=7)
        for name, tensor in parts.state_dict().items():
            assert torch.equal(tensor, expected[name]), name


def test_cpu_offload_puts_the_stages_rope_tables_on_the_device_as_the_whole_models():
    # NOTE: the meta device stands in for a GPU: the parameters stay on the CPU, the buffers go to the device.
    config = pp_worker.pp_config()
    with torch.device("meta"):
        whole = GPT(config)
        parts = build_pipeline_parts(config, pp_rank=0, pp_size=2, virtual_stages=2)
    for model in (whole, parts):
        materialize(model, torch.device("meta"), seed=7, cpu_offload=True)
    assert whole.rope_cos.is_meta and not whole.wte.weight.is_meta
    for stage in parts.stages:
        assert stage.rope_cos.is_meta and stage.rope_sin.is_meta
    assert not any(parameter.is_meta for parameter in parts.parameters())


def test_stages_split_layers_evenly_extra_layers_first():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert rank_stages(1, 2, 2) == [1, 3]
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layers(2, 4)


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
def test_pp2_sharded_checkpoint_resumes_in_one_process(launches):
    two, workdir = launches["two"], launches.workdir
    step = workdir / "pp2" / "step-00000004"
    assert checkpoint_format(step) == "sharded" and (step / "dcp" / ".metadata").is_file()
    result = pp_worker.train(Runtime(), out_dir=workdir / "one", resume_from=step)
    assert_same_training(result, two["1f1b"], steps=range(5, 9))
    torch.testing.assert_close(result["weights"], two["1f1b"]["weights"], rtol=1e-4, atol=1e-6)


@pytest.mark.multiproc
def test_pp2_dp2_full_checkpoint_resumes_in_one_process(launches):
    four, workdir = launches["four"], launches.workdir
    step = workdir / "pp2_dp2" / "step-00000004"
    assert checkpoint_format(step) == "full"
    result = pp_worker.train(Runtime(), out_dir=workdir / "one_full", checkpoint_format="full", resume_from=step)
    assert_same_training(result, four["pp2_dp2"], steps=range(5, 9))


@pytest.mark.multiproc
def test_full_checkpoint_resumes_under_pp2_dp2(launches):
    assert_same_training(launches["four"]["resumed_full"], launches["four"]["pp2_dp2"], steps=range(5, 9))


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["pp2", "pp2_dp2", "tp2_pp2"])
def test_final_of_a_pipeline_run_holds_every_weight(launches, run):
    final = launches.workdir / run / "final"
    assert checkpoint_format(final) == "full"
    model = GPT(Config.from_file(final / layout.CONFIG_FILE))
    load_weights(model, final)  # every weight present, with its shape
    gathered = launches["two"]["1f1b"] if run == "pp2" else launches["four"][run]
    gathered = gathered["weights"]
    assert gathered.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, gathered[name]), name


# --------------------------------------------------------------------------------- the CLI
DEBUG = ["--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--train.max_steps", "4",
         "--train.max_seq_length", "64", "--train.micro_batch_size", "2", "--eval.max_iters", "2",
         "--eval.interval", "2", "--data.max_bytes", "2000000"]


def llmtrain_cli(*argv: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def cli_env(dist_env, tmp_path_factory) -> dict:
    return dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))


@pytest.mark.multiproc
def test_pretrain_pp2_dp2_through_the_cli_converts_to_transformers(tmp_path, cli_env):
    from transformers import AutoModelForCausalLM

    from llmtrain.model_dir import load_model_dir
    from llmtrain.cli import main

    out_dir = tmp_path / "pp"
    result = llmtrain_cli("pretrain", *DEBUG, "--out_dir", str(out_dir), "--devices", "4", "--pp_size", "2",
                          env=cli_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "pipeline 2 × shard 2" in result.stdout and "val_loss" in result.stdout
    hf_dir = tmp_path / "hf"
    main(["convert", "to_hf", str(out_dir / "final"), str(hf_dir)])
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    model, *_ = load_model_dir(out_dir / "final")
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids)[..., :hf_model.config.vocab_size],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flags, says", [
    (["--pp_size", "4", "--pp_schedule", "interleaved_1f1b"], "more than the 4 layers"),
    (["--pp_size", "2", "--pp_schedule", "1f1b", "--train.micro_batch_size", "8"], "needs at least --pp_size 2"),
    (["--pp_size", "2", "--model_name", "qwen2-debug"], "ties its embedding to its output head"),
])
def test_bad_pipeline_flags_exit_2_before_any_worker(tmp_path, cli_env, monkeypatch, capsys, flags, says):
    from llmtrain.cli import main

    monkeypatch.setattr(sys, "argv", ["llmtrain", "pretrain", *DEBUG, "--out_dir", str(tmp_path / "o"), "--devices",
                                      "4", *flags])  # as typed on the command line: one message, exit code 2
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", cli_env["LLMTRAIN_CACHE_DIR"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert says in message and "Traceback" not in message
    assert len([p for p in message.split("\n\n") if p.strip()]) == 1, message
    assert not (tmp_path / "o").exists()


def test_default_schedule_is_1f1b_or_gpipe_when_a_step_has_fewer_micro_batches_than_stages():
    from llmtrain.args import TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan

    def plan(micro_batch_size: int, schedule=None) -> ParallelPlan:
        return ParallelPlan.resolve(devices=4, num_nodes=1, train=TrainArgs(global_batch_size=16,
                                    micro_batch_size=micro_batch_size), precision="32-true", device_type="cpu", pp=2,
                                    pp_schedule=schedule)

    assert (plan(2).pp_schedule, plan(2).pp_microbatches) == ("1f1b", 4)
    assert (plan(8).pp_schedule, plan(8).pp_microbatches) == ("gpipe", 1)  # debug.yaml's batch at --devices 4
    with pytest.raises(ValueError, match="--pp_schedule 1f1b needs at least --pp_size 2 micro-batches"):
        plan(8, "1f1b")


def test_gradient_sync_every_micro_batch_is_refused_under_a_pipeline():
    from llmtrain.args import FSDPArgs, TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan

    def plan(skip_gradient_sync: bool, pp: int) -> ParallelPlan:
        return ParallelPlan.resolve(devices=4, num_nodes=1, train=TrainArgs(global_batch_size=16, micro_batch_size=2),
                                    precision="32-true", device_type="cpu", pp=pp,
                                    fsdp=FSDPArgs(skip_gradient_sync=skip_gradient_sync))

    assert not plan(False, pp=1).grad_sync_only_last  # without a pipeline the flag is honoured
    assert plan(True, pp=2).wrapper == "fsdp"
    # The schedule syncs only the last micro-batch's backward (torch's PipelineStage), whatever the flag says.
    with pytest.raises(ValueError, match="--fsdp.skip_gradient_sync false: under --pp_size 2 the pipeline schedule"):
        plan(False, pp=2)


# ----------------------------------------------------------------- what rank 0 receives (issue 41)
def largest_tensor_bytes() -> int:
    """The bytes of the largest tensor in the 4-layer model's fp32 weights and AdamW state: the embedding's."""
    return max(parameter.numel() * 4 for parameter in GPT(pp_worker.pp_config()).parameters())


def pipeline_rank_state_bytes(pp_rank: int, *, virtual_stages: int, optimizer: bool) -> int:
    """The bytes of pipeline rank ``pp_rank``'s (of 2) fp32 weights, and with ``optimizer`` its AdamW state too (two
    moments per weight, and a 0-d fp32 step per parameter)."""
    with torch.device("meta"):
        parts = build_pipeline_parts(pp_worker.pp_config(), pp_rank=pp_rank, pp_size=2, virtual_stages=virtual_stages)
    parameters = list(parts.parameters())
    numel = sum(parameter.numel() for parameter in parameters)
    return numel * 4 + (numel * 8 + len(parameters) * 4 if optimizer else 0)


def received_state_bytes(records: list) -> int:
    """The fp32 bytes rank 0 received point to point: the tensors of other stages' state."""
    return sum(size for name, size, dtype in records if name == "recv" and dtype == "torch.float32")


@pytest.mark.multiproc
@pytest.mark.parametrize("suite, run, label, saves, virtual_stages", [
    ("four", "pp2_dp2", "save", 2, 1),  # full checkpoints at steps 4 and 8 (final/ links the last one's files)
    ("four", "tp2_pp2", "save", 2, 2),  # the same, interleaved, each tensor gathered over its tensor-parallel ranks
    ("two", "1f1b", "save_final", 1, 1),  # final/ of a sharded run: the whole weights, gathered
])
def test_full_state_paths_send_rank0_one_tensor_at_a_time_and_one_copy_whatever_the_world(launches, suite, run,
                                                                                         label, saves, virtual_stages):
    """No collective brings rank 0 more than the largest tensor's bytes (gather_object of every rank's pickled stages
    did: world size times the largest), and what it receives is exactly pipeline rank 1's state, once per save: the
    same bytes at pp2 × dp2 or × tp2 as at pp2."""
    records = launches[suite][run]["received"][label]
    limit = largest_tensor_bytes()
    assert records, "the recording saw no collective"
    assert [record for record in records if record[1] > limit] == []
    expected = pipeline_rank_state_bytes(1, virtual_stages=virtual_stages, optimizer=label == "save")
    assert received_state_bytes(records) == saves * expected
    assert [record for record in records if record[:1] == ("recv",) and record[2] == "torch.uint8"] == [], \
        "rank 0 predicts AdamW's state: no stage sends a pickled skeleton"


@pytest.mark.multiproc
def test_an_optimizer_state_rank0_cannot_predict_comes_with_its_skeleton_and_round_trips(launches):
    """Adafactor keeps a row and a column per matrix, not a tensor like it: the stage sends its state's skeleton (a
    pickled object without tensors) ahead of the tensors, and the checkpoint holds each parameter's entries as one
    process's Adafactor has them; a resume from it continues as the run did."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from llmtrain.checkpoint.state import load_training_state

    two = launches["two"]
    records = two["adafactor"]["received"]["save"]
    assert [record for record in records if record[1] > largest_tensor_bytes()] == []
    skeletons = [record for record in records if record[0] == "recv" and record[2] == "torch.uint8"]
    assert len(skeletons) == 2  # one per save (steps 4 and 8), the optimizer state's: the weights are predicted
    model = GPT(pp_worker.pp_config())
    reference = torch.optim.Adafactor(model.parameters(), lr=5e-3, weight_decay=0.1)
    sum(parameter.sum() for parameter in model.parameters()).backward()
    reference.step()
    expected = {name: {key: tuple(value.shape) for key, value in entries.items()}
                for name, entries in get_optimizer_state_dict(model, reference)["state"].items()}
    saved = load_training_state(launches.workdir / "adafactor" / "step-00000004")["optimizer"]["state"]
    assert {name: {key: tuple(value.shape) for key, value in entries.items()} for name, entries in saved.items()} \
        == expected
    assert two["adafactor_resumed"]["restored"] == [[], []]
    assert_same_training(two["adafactor_resumed"], two["adafactor"], steps=range(5, 9))


@pytest.mark.multiproc
def test_full_checkpoint_resume_under_pp2_dp2_sends_nothing_and_restores_every_shard_bit_exactly(launches):
    """Each rank reads its own stage's weights and optimizer entries from the checkpoint's files: rank 0 receives no
    state at all, and every rank's shards of weights and AdamW moments equal those it saved."""
    resumed = launches["four"]["resumed_full"]
    assert [record for record in resumed["received"]["load"] if record[1] > 8] == []  # at most a counter or two
    assert resumed["restored"] == [[], [], [], []]  # the shards' differences, per rank


@pytest.mark.multiproc
def test_pp2_dp2_initial_weights_each_rank_reads_only_its_stage(launches):
    """--initial_checkpoint_dir under a pipeline: each rank reads its stage's tensors from model.safetensors, by name,
    and nothing is broadcast; the stages then hold what one process loads from the file."""
    result = launches["four"]["initial_weights"]
    assert result["received"] == []
    stage_names = result["stage_names"]
    assert stage_names[0] == stage_names[1] and stage_names[2] == stage_names[3]  # pp × dp: ranks 0, 1 hold stage 0
    assert not set(stage_names[0]) & set(stage_names[2])
    for reads, names in zip(result["reads"], stage_names):
        assert sorted(reads) == names
    model = GPT(pp_worker.pp_config())
    load_weights(model, result["model_dir"])
    assert result["weights"].keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(result["weights"][name], tensor), name


# ------------------------------------------------------------------- FSDP inside a pipeline's stages
@pytest.mark.multiproc
def test_fsdp_keeps_each_stage_gathered_through_the_step_under_pp2_dp2(launches):
    """reshard_after_forward is off under a pipeline: resharding after each micro-batch's forward would all-gather the
    stage again for every micro-batch (the parity tests show the results are unchanged)."""
    assert launches["four"]["pp2_dp2"]["resharding_units"] == []


def test_full_and_hybrid_shard_keep_weights_gathered_after_forward_only_under_a_pipeline():
    from llmtrain.args import FSDPArgs, TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan

    def plan(sharding: str, pp: int, num_nodes: int = 1) -> ParallelPlan:
        return ParallelPlan.resolve(devices=4, num_nodes=num_nodes, train=TrainArgs(global_batch_size=32,
                                    micro_batch_size=1), precision="32-true", device_type="cpu", pp=pp,
                                    fsdp=FSDPArgs(sharding_strategy=sharding))

    assert plan("FULL_SHARD", pp=1).reshard_after_forward
    assert plan("HYBRID_SHARD", pp=1, num_nodes=2).reshard_after_forward
    assert not plan("FULL_SHARD", pp=2).reshard_after_forward
    assert not plan("HYBRID_SHARD", pp=2, num_nodes=2).reshard_after_forward
    assert not plan("SHARD_GRAD_OP", pp=1).reshard_after_forward


# ------------------------------------------------------------------------------ pipeline inputs
def bare_pipeline(device: torch.device):
    """A Pipeline with only what moving its inputs needs (its schedule needs a process group)."""
    from types import SimpleNamespace

    from llmtrain.distributed.pipeline import Pipeline

    pipeline = object.__new__(Pipeline)
    pipeline.device, pipeline.micro_batch_size, pipeline.parts = device, 2, SimpleNamespace(max_seq_length=8)
    return pipeline


def test_pipeline_inputs_are_padded_and_nothing_is_pinned_on_a_cpu():
    from llmtrain.loss import IGNORE_INDEX

    batch = {"input_ids": torch.arange(6).reshape(1, 6), "labels": torch.arange(1, 7).reshape(1, 6)}
    ids, labels = bare_pipeline(torch.device("cpu"))._concatenated([batch, None])
    assert ids.shape == labels.shape == (4, 8)
    assert ids[0, :6].tolist() == list(range(6)) and ids[0, 6:].tolist() == [0, 0] and not ids[1:].any()
    assert labels[0, :6].tolist() == list(range(1, 7)) and (labels[1:] == IGNORE_INDEX).all()
    assert (labels[0, 6:] == IGNORE_INDEX).all()
    assert not ids.is_pinned() and not labels.is_pinned()
    assert not torch.cuda.is_initialized()  # pinning makes a CUDA context (and fails on a torch without CUDA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_inputs_go_to_the_gpu_from_pinned_memory(monkeypatch):
    from llmtrain.distributed import pipeline as pipeline_module

    hosts = []
    concatenated = pipeline_module.concatenated_batches

    def spy(*args, **kwargs):
        hosts.extend(concatenated(*args, **kwargs))
        return tuple(hosts[-2:])

    monkeypatch.setattr(pipeline_module, "concatenated_batches", spy)
    batch = {"input_ids": torch.arange(6).reshape(1, 6), "labels": torch.arange(1, 7).reshape(1, 6)}
    ids, labels = bare_pipeline(torch.device("cuda", 0))._concatenated([batch, None])
    assert ids.is_cuda and labels.is_cuda and ids[0, :6].tolist() == list(range(6))
    assert len(hosts) == 2 and all(host.is_pinned() for host in hosts)
