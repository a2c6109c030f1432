"""DeepSpeed ZeRO (extensions/deepspeed): parity with FSDP, crash safety, fine-tuning, conversion and bad input.

One 2-process launch (tests/helpers/ds_worker.py) trains the tiny model under FSDP and then under every
``--strategy deepspeed_*`` in the same process group, in fp32 and in bf16, and in the same ranks streams final/'s
weights and writes the checkpoints that other numbers of ranks load (TWO_RANK_SUITES); the other multi-process tests run the real command line
(``llmtrain ... --devices 2 --strategy deepspeed_stage_N``) and share one uninterrupted run. Bad input goes through
the console script in one process per batch of command lines (ds_worker.run_command_lines), which stops any that
gets as far as starting workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from dist_worker import CHILD_PATHS, launch
from limits import hard_limit
from llmtrain.args import TrainArgs
from llmtrain.checkpoint import layout
from llmtrain.cli import main
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES, ParallelPlan
from llmtrain.signals import PREEMPTED_EXIT_CODE
from llmtrain_deepspeed.config import INSTALL_COMMAND, build_config, read_config, zero_settings

from conftest import write_tiny_model
from runs import (MAX_STEPS, STOPPED, assert_same_weights, finetune_args, launcher, losses,  # noqa: F401 (fixtures)
                  resumable_args, step_of)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ROOT = Path(__file__).resolve().parents[2]
STRATEGY = ("--strategy", "deepspeed_stage_2")
DS_ENV = {"DS_ACCELERATOR": "cpu"}

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason=f"the deepspeed package is not installed ({INSTALL_COMMAND})")


@pytest.fixture(autouse=True)
def time_limit(request):
    # The first test that asks for the `from_reference` batch runs its four command lines (about 2 minutes).
    with hard_limit(1800 if "from_reference" in request.fixturenames else 600, request.node.name):
        yield


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


@pytest.fixture
def model_file(tmp_path_factory) -> Path:
    """The tiny model with room for instructions (block 128), so the pretraining run's final/ fine-tunes too."""
    return write_tiny_model(tmp_path_factory.getbasetemp() / "tiny-deepspeed.yaml", block_size=128)


# ------------------------------------------------------------------------------- parity with FSDP
TWO_RANK_SUITES = ("final_stream", "universal_save", "parity_bf16", "parity", "zero3_build")
"""The 2-rank suites of ds_worker, run one after the other by the same two ranks (one start-up of torch and
DeepSpeed for all): parity after the others that train, as it changes dist_worker's samples and the attention path
for itself, and zero3_build (which trains nothing) last, as it changes dist_worker's global batch."""
THREE_RANK_SUITES = ("zero3_build", "universal_load")
"""The same for three ranks (universal_load sets the global batch it needs itself)."""


@pytest.fixture(scope="module")
def two_rank_suites(tmp_path_factory) -> tuple[Path, dict]:
    """The workdir (where universal_save's checkpoints are) and each suite's results."""
    workdir = tmp_path_factory.mktemp("ds-two-ranks")
    return workdir, launch(2, "+".join(TWO_RANK_SUITES), workdir, timeout_s=900, script=HELPERS / "ds_worker.py")


@pytest.fixture(scope="module")
def three_rank_suites(two_rank_suites) -> dict:
    """Each suite's results, in the 2-rank launch's workdir (universal_load loads universal_save's checkpoints there;
    zero3_build writes its model folders anew)."""
    return launch(3, "+".join(THREE_RANK_SUITES), two_rank_suites[0], timeout_s=900, script=HELPERS / "ds_worker.py")


def suites_of(world_size: int, request) -> dict:
    """The results of the suites that ``world_size`` ranks ran together."""
    if world_size == 2:
        return request.getfixturevalue("two_rank_suites")[1]
    return request.getfixturevalue("three_rank_suites")


@pytest.fixture(scope="module")
def parity(two_rank_suites) -> dict:
    return two_rank_suites[1]["parity"]


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", list(DEEPSPEED_STRATEGIES))
def test_every_zero_stage_matches_fsdp(parity, strategy):
    """8 AdamW steps (clipping, warmup, padding that differs per rank, and widths that differ between the ranks so
    that only one takes the fused q/k/v path): the losses, gradient norms and final weights of each ZeRO variant
    equal FSDP's to float precision, and each really shards what it says."""
    fsdp, ours = parity["fsdp"], parity[strategy]
    settings = DEEPSPEED_STRATEGIES[strategy]
    assert sorted(ours["losses"]) == list(range(1, 9))
    for step, loss in fsdp["losses"].items():
        assert ours["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
        assert ours["grad_norms"][step] == pytest.approx(fsdp["grad_norms"][step], rel=1e-4, abs=1e-5), step
    assert ours["weights"].keys() == fsdp["weights"].keys()
    for name, tensor in fsdp["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=1e-4, atol=2e-5, msg=name)
    total = sum(tensor.numel() for tensor in fsdp["weights"].values())
    assert ours["stage"] == settings.stage and ours["offload_optimizer"] == settings.offload_optimizer
    assert total / 2 <= ours["optimizer_numel"] < total * 0.55  # each rank's half of the fp32 master weights
    assert ours["parameters_numel"] == (0 if settings.stage == 3 else total)  # stage 3: partitioned between steps


@pytest.fixture(scope="module")
def parity_bf16(two_rank_suites) -> dict:
    return two_rank_suites[1]["parity_bf16"]


@needs_deepspeed
@pytest.mark.multiproc
def test_bf16_gradients_are_accumulated_and_reduced_in_fp32(parity_bf16):
    """One step of 4 micro-batches on 2 ranks in bf16-mixed: the gradient the engine ends with equals the exact
    (float64) average of the same bf16 micro-batch gradients to within 1e-5 of each parameter's largest gradient.

    Accumulating and reducing in fp32 adds at most about 8 roundings of 2^-24 (6e-8 each) to a sum of 8 bf16
    terms; one bf16 rounding alone is 2^-9 (2e-3). 1e-5 leaves fp32 a margin of 20x and bf16 none: DeepSpeed's
    own default (bf16 accumulation and reduction, the control) misses it by more than 100x."""
    errors = parity_bf16["gradient_error"]
    for strategy in ("deepspeed_stage_1", "deepspeed_stage_2"):
        assert errors[strategy] < 1e-5, (strategy, errors)
    assert errors["bf16_reduction"] > 1e-3, errors  # the test tells the two apart


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_bf16_training_under_each_zero_stage_follows_fsdp(parity_bf16, strategy):
    """8 AdamW steps in bf16-mixed under FSDP (fp32 reduction) and under ZeRO with llmtrain's config.

    Both compute in bf16 from the same initial weights, but not bit for bit alike (the first losses differ by
    1e-4 already), and ZeRO's fp32 master weights start as the bf16-rounded values while FSDP's keep the fp32 draw;
    after that each step's bf16 copy of the weights rounds its own way. Measured: the losses stay within 8e-4 and the
    gradient norms within 7e-3 (relative) of FSDP's over the 8 steps; the bounds below (2e-3 and 2e-2, about half
    of bf16's 2^-8 and 5x that) hold those with a margin, and catch a gradient that is not averaged or a step
    that is lost, which move the loss by percents. Stage 1 runs on DeepSpeed's BF16_Optimizer, which still
    partitions the fp32 master weights."""
    fsdp, ours = parity_bf16["fsdp"], parity_bf16[strategy]
    assert sorted(ours["losses"]) == list(range(1, 9))
    for step, loss in fsdp["losses"].items():
        assert ours["losses"][step] == pytest.approx(loss, rel=2e-3), step
        assert ours["grad_norms"][step] == pytest.approx(fsdp["grad_norms"][step], rel=2e-2), step
    total = sum(tensor.numel() for tensor in fsdp["weights"].values())
    assert total / 2 <= ours["optimizer_numel"] < total * 0.55  # each rank's half of the fp32 master weights
    for name, tensor in fsdp["weights"].items():  # Adam's step follows a small gradient's sign: 1.4e-2 measured
        assert (ours["weights"][name] - tensor).norm() < 5e-2 * tensor.norm(), name


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_stage_3_model_is_built_partitioned_with_the_weights_of_every_other_strategy(world_size, request):
    """Under deepspeed.zero.Init each rank holds 1/world of the parameters right after the build (with the padding
    of each parameter to an even split: on 3 ranks partitions start inside rows), and the weights gathered whole
    equal, bit for bit, those that
    materialize gives a model built whole in one process with the same seed: in fp32, in bf16 (the fp32 draw
    rounded), with tied embeddings and sizes 2 does not divide; and so are weights read from a file (each rank its
    own partitions' rows), for LoRA's base and for the tied, unevenly sized model."""
    from dist_worker import SEED, tiny_config, uneven_tied_config

    from llmtrain.distributed.parallelize import materialize
    from llmtrain.lora import LoRAArgs, apply_lora, reset_lora_parameters
    from llmtrain.model import GPT

    zero3_build = suites_of(world_size, request)["zero3_build"]

    def reference(config, lora=None) -> dict:
        with torch.device("meta"):
            model = GPT(config)
        if lora is not None:
            apply_lora(model, lora)
        materialize(model, torch.device("cpu"), SEED, after_init=reset_lora_parameters if lora else None)
        return model.state_dict()

    for name, config, dtype in (("tiny", tiny_config(), torch.float32), ("tiny_bf16", tiny_config(), torch.bfloat16),
                                ("uneven_tied", uneven_tied_config(), torch.float32)):
        built = zero3_build[name]
        assert built["whole"] == sum(p.numel() for p in GPT(config).parameters())
        held_at_most = built["whole"] / world_size + len(built["weights"])  # at most one padding element each
        assert built["whole"] / world_size <= built["held"] <= held_at_most, name
        expected = reference(config)
        assert built["weights"].keys() == expected.keys()
        for key, tensor in expected.items():
            assert built["weights"][key].dtype == dtype and torch.equal(built["weights"][key], tensor.to(dtype)), key
    assert zero3_build["uneven_tied"]["tied"]

    lora = LoRAArgs(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True)
    expected, base = reference(tiny_config(), lora), zero3_build["tiny"]["weights"]
    loaded = zero3_build["lora"]["weights"]
    assert loaded.keys() == expected.keys()
    for key, tensor in loaded.items():
        plain = key.replace(".base.", ".")
        want = expected[key] if "lora_" in key else base[plain] * 3  # the file held the base weights times 3
        assert torch.equal(tensor, want), key
    assert zero3_build["lora"]["trainable"] and all("lora_" in n for n in zero3_build["lora"]["trainable"])
    uneven = zero3_build["uneven_tied"]["weights"]
    for key, tensor in zero3_build["uneven_tied_loaded"]["weights"].items():
        assert torch.equal(tensor, uneven[key] * 3), key


@needs_deepspeed
@pytest.mark.multiproc
def test_final_weights_stream_one_tensor_at_a_time_on_rank_0(two_rank_suites):
    """final/'s weights come to rank 0's writer one at a time: the fp32 master of every parameter, gathered from
    both ranks' partitions (stage 3 in fp32; stage 2 in bf16, where the module holds bf16 and final/ must hold the
    fp32 masters, after one step), and no earlier tensor is kept alive by the stream while the next is written."""
    streams = two_rank_suites[1]["final_stream"]
    for strategy, stream in streams.items():
        assert stream["streamed"].keys() == stream["weights"].keys(), strategy
        for name, tensor in stream["weights"].items():
            assert stream["streamed"][name].dtype == torch.float32
            assert torch.equal(stream["streamed"][name], tensor), (strategy, name)
        if strategy == "deepspeed_stage_2":  # the module's bf16 weights are not what final/ holds
            assert not all(torch.equal(stream["module"][name], t) for name, t in stream["weights"].items())
        largest = max(tensor.nbytes for tensor in stream["weights"].values())
        assert stream["most_alive"] <= largest < sum(t.nbytes for t in stream["weights"].values()) / 4, strategy


@pytest.fixture(scope="module")
def universal_saved(two_rank_suites) -> tuple[Path, dict]:
    workdir, results = two_rank_suites
    return workdir, results["universal_save"]


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [1, 3])
def test_zero_3_and_bf16_zero_1_checkpoints_of_2_ranks_load_on_another_number_exactly(universal_saved, world_size,
                                                                                      request):
    """ZeRO 3's partitioned files (fp32) and ZeRO 1's in bf16 (DeepSpeed's BF16_Optimizer), written by 2 ranks after
    two AdamW steps, loaded by 1 and by 3 through the universal checkpoint: every parameter's fp32 master and both
    Adam moments come back bit for bit, and the converted folder is gone."""
    workdir, saved = universal_saved
    loaded = (suites_of(world_size, request)["universal_load"] if world_size == 3 else
              launch(world_size, "universal_load", workdir, timeout_s=300, script=HELPERS / "ds_worker.py"))
    for strategy, before in saved.items():
        after = loaded[strategy]
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            assert after[key].keys() == before[key].keys(), (strategy, key)
            for name, tensor in before[key].items():
                assert torch.equal(after[key][name], tensor), (strategy, key, name)
        assert any(tensor.abs().sum() > 0 for tensor in before["exp_avg"].values())  # the moments are not empty
        assert after["left"] == [], strategy


# ------------------------------------------------------------------------------- the command line
_REFERENCE: dict = {}


@pytest.fixture
def reference(launcher, tmp_path_factory) -> Path:
    """The out_dir of one uninterrupted ``--devices 2 --strategy deepspeed_stage_2`` pretraining run (made once)."""
    if not _REFERENCE:
        out_dir = tmp_path_factory.mktemp("ds-reference")
        launcher.complete(out_dir, *STRATEGY, env=DS_ENV)
        _REFERENCE["out_dir"] = out_dir
    return _REFERENCE["out_dir"]


FINETUNES = [("finetune_full", "deepspeed_stage_2", "32-true"), ("finetune_lora", "deepspeed_stage_3", "32-true"),
             ("finetune_lora", "deepspeed_stage_2", "bf16-mixed")]
"""The fine-tuning runs from the DeepSpeed pretraining run's final/: (recipe, strategy, precision)."""


def finetune_extra(recipe: str, strategy: str, precision: str, directory: Path) -> list[str]:
    """The flags of one of FINETUNES (LoRA under stage 3 with a --deepspeed.config, written to ``directory``, that
    partitions every parameter)."""
    extra = ["--strategy", strategy, "--devices", "2", "--train.max_steps", "2", "--precision", precision,
             "--lora_dropout", "0"][:None if recipe == "finetune_lora" else -2]
    if strategy == "deepspeed_stage_3":
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "ds.json"
        config.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
        extra += ["--deepspeed.config", str(config)]
    return extra


_FROM_REFERENCE: dict = {}


@pytest.fixture
def from_reference(reference, dist_env, model_file, tmp_path_factory) -> dict:
    """The command lines that start from the reference run, each `python -m llmtrain ...` as a process of its own,
    forked one after the other from one interpreter (tests/helpers/forked_cli: one start-up of torch, jsonargparse
    and torch._dynamo for the launching processes of all; the workers they spawn are new interpreters): each of
    FINETUNES from its final/, and its step-4 checkpoint resumed by one process. Made once, by the first test that
    asks; by name: (result, out_dir, flags)."""
    if not _FROM_REFERENCE:
        from forked_cli import run_forked

        root = tmp_path_factory.mktemp("ds-from-reference")
        runs = {}
        for recipe, strategy, precision in FINETUNES:
            name = f"{recipe}-{strategy}-{precision}"
            extra = finetune_extra(recipe, strategy, precision, root / "configs" / name)
            runs[name] = (finetune_args(recipe, reference / "final", root / name / recipe, *extra), root / name / recipe,
                          extra)
        out_dir = root / "one"
        runs["one process"] = (resumable_args(model_file, out_dir, *STRATEGY, "--devices", "1", "--resume",
                                              str(reference / "step-00000004")), out_dir, [])
        # NOTE: a hang guard: the four take about two minutes alone, several times that beside other work.
        done = run_forked([argv for argv, _, _ in runs.values()], root / "logs", {**dist_env, **DS_ENV},
                          timeout_s=1500, at_once=1)
        _FROM_REFERENCE.update({name: (result, out_dir, extra)
                                for (name, (_, out_dir, extra)), result in zip(runs.items(), done)})
    return _FROM_REFERENCE


@needs_deepspeed
@pytest.mark.multiproc
def test_kill_9_and_sigterm_then_resume_auto_match_an_uninterrupted_run(launcher, reference, tmp_path):
    """Killed with -9 between steps, then stopped by SIGTERM to the launcher: the stop writes a complete
    DeepSpeed checkpoint of its step and exits 75, and the twice resumed run ends with the uninterrupted run's
    weights, bit for bit."""
    out_dir = tmp_path / "run"
    first = launcher.start(out_dir, *STRATEGY, "--resume", "auto", env=DS_ENV)
    first.wait_for(r"^step 6 \|")  # after the step-4 checkpoint
    first.kill_9()
    resumed_from = layout.latest_checkpoint(out_dir)
    assert resumed_from is not None and step_of(resumed_from) >= 4

    second = launcher.start(out_dir, *STRATEGY, "--resume", "auto", env=DS_ENV)
    second.wait_for(rf"^step {step_of(resumed_from) + 1} \|")
    os.kill(second.proc.pid, signal.SIGTERM)
    assert second.finish() == PREEMPTED_EXIT_CODE, second.output
    assert f"resumed from {resumed_from}" in second.output
    step = int(STOPPED.search(second.output).group(1))
    assert step_of(resumed_from) < step < MAX_STEPS
    latest = layout.latest_checkpoint(out_dir)
    assert latest == out_dir / layout.step_dir_name(step)
    assert sorted(p.name for p in latest.glob("*optim_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]
    assert not (out_dir / "final").exists()

    last = launcher.start(out_dir, *STRATEGY, "--resume", "auto", env=DS_ENV)
    assert last.finish() == 0, last.output
    assert f"resumed from {latest}" in last.output
    assert not list(out_dir.glob("zero_to_*.py"))  # DeepSpeed's recovery scripts are not left in out_dir
    assert_same_weights(out_dir, load_file(str(reference / "final" / "model.safetensors")))


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("recipe, strategy, precision", [("finetune_full", "deepspeed_stage_2", "32-true"),
                                                         ("finetune_lora", "deepspeed_stage_3", "32-true"),
                                                         ("finetune_lora", "deepspeed_stage_2", "bf16-mixed")])
def test_fine_tuning_under_deepspeed_writes_a_final_model_that_loads(reference, from_reference, dist_env, recipe,
                                                                     strategy, precision):
    """Two steps on 2 processes from the DeepSpeed pretraining run's final/; LoRA under stage 3 with every
    parameter partitioned (a --deepspeed.config lowers the persistence threshold). final/ loads and answers;
    LoRA's is the base plus its adapters' product, every other weight the base's bit for bit, also in bf16-mixed,
    where the engine holds the frozen base in bf16."""
    from llmtrain.generate import load_model_dir

    base = reference / "final"
    result, out_dir, extra = from_reference[f"{recipe}-{strategy}-{precision}"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ZeRO stage {strategy[-1]}" in result.stdout
    assert sorted(losses(out_dir)) == [1, 2]
    model, *_ = load_model_dir(out_dir / "final", device="cpu", dtype=torch.float32)
    assert torch.isfinite(model(torch.randint(0, 1000, (1, 16)))).all()
    merged = load_file(str(out_dir / "final" / "model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    assert merged.keys() == weights.keys()
    if recipe == "finetune_full":
        assert all(not torch.equal(merged[name], tensor) for name, tensor in weights.items() if "norm" not in name)
        return
    adapters = load_file(str(out_dir / "final" / "lora.safetensors"))
    assert adapters and all(name.endswith(("lora_A", "lora_B")) for name in adapters)
    if strategy == "deepspeed_stage_2":  # its step checkpoint, DeepSpeed's files and lora.yaml, resumes
        extra = list(extra)
        extra[extra.index("--train.max_steps") + 1] = "3"
        resumed = subprocess.run([sys.executable, "-m", "llmtrain", *finetune_args(recipe, base, out_dir, *extra),
                                  "--resume", "auto"], env={**dist_env, **DS_ENV}, capture_output=True, text=True,
                                 timeout=500, cwd=ROOT)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resumed from {out_dir / layout.step_dir_name(2)}" in resumed.stdout and 3 in losses(out_dir)
    assert any(tensor.abs().sum() > 0 for name, tensor in adapters.items() if name.endswith("lora_B"))  # it trained
    for name, tensor in weights.items():
        prefix = name.rsplit(".", 1)[0]
        if f"{prefix}.lora_A" in adapters and name.endswith(".weight"):
            delta = adapters[f"{prefix}.lora_B"] @ adapters[f"{prefix}.lora_A"] * (16 / 8)  # lora_alpha / lora_r
            torch.testing.assert_close(merged[name], tensor + delta, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(merged[name], tensor), name


@needs_deepspeed
@pytest.mark.multiproc
def test_a_deepspeed_final_converts_to_transformers_with_the_same_logits(reference, tmp_path):
    from hf_reference import load_transformers, tokens

    from llmtrain.generate import load_model_dir

    main(["convert", "to_hf", str(reference / "final"), str(tmp_path / "hf")])
    ours, *_ = load_model_dir(reference / "final", device="cpu", dtype=torch.float32)
    ids = tokens(vocab_size=1000)
    with torch.no_grad():
        torch.testing.assert_close(load_transformers(tmp_path / "hf")(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- bad input: exit 2
def command_lines(cases: dict[str, dict], workdir: Path, env: dict) -> dict[str, dict]:
    """Run the cases (name -> {"argv": [...], "hide_deepspeed": bool}) through the console script in one process."""
    (workdir / "cases.json").write_text(json.dumps(list(cases.values())))
    result = subprocess.run([sys.executable, str(HELPERS / "ds_worker.py"), "command-lines", str(workdir / "cases.json"),
                             str(workdir / "results.json")], capture_output=True, text=True, timeout=300,
                            env={**env, "PYTHONPATH": os.pathsep.join(map(str, CHILD_PATHS))},
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(zip(cases, json.loads((workdir / "results.json").read_text())))


def assert_refused(result: dict, *fragments: str) -> None:
    """Exit 2 with one message and no traceback, and no worker started."""
    stderr = result["stderr"]
    assert result["code"] == 2 and not result["launched"], result
    assert "Traceback" not in stderr and stderr.count("error:") == 1, stderr
    message = " ".join(stderr.split())
    for fragment in fragments:
        assert fragment in message, message


def ds_file(directory: Path, name: str, config: dict) -> str:
    (directory / name).write_text(json.dumps(config))
    return str(directory / name)


BAD_INPUTS = {
    "batch size": (lambda d: ["--train.global_batch_size", "8", "--strategy", "deepspeed",
                              "--deepspeed.config", ds_file(d, "batch.json", {"train_batch_size": 16,
                                                                               "zero_optimization": {"stage": 2}})],
                   ["sets train_batch_size 16, but --train.global_batch_size makes it 8"]),
    "optimizer section": (lambda d: ["--strategy", "deepspeed_stage_2", "--deepspeed.config",
                                     ds_file(d, "optimizer.json", {"optimizer": {"type": "Adam"}})],
                          ["has an 'optimizer' section", "--optimizer"]),
    "activation checkpointing section": (lambda d: ["--strategy", "deepspeed_stage_2", "--deepspeed.config", ds_file(
        d, "checkpointing.json", {"activation_checkpointing": {"partition_activations": True}})],
        ["has an 'activation_checkpointing' section", "--fsdp.activation_checkpointing"]),
    "no config": (lambda d: ["--strategy", "deepspeed"], ["--strategy deepspeed takes its ZeRO stage from "
                                                          "--deepspeed.config"]),
    "stage contradicts": (lambda d: ["--strategy", "deepspeed_stage_2", "--deepspeed.config",
                                     ds_file(d, "stage3.json", {"zero_optimization": {"stage": 3}})],
                          ["--strategy deepspeed_stage_2 means ZeRO stage 2, but --deepspeed.config says ZeRO stage 3"]),
    "bf16-true": (lambda d: ["--strategy", "deepspeed_stage_1", "--precision", "bf16-true"],
                  ["--precision bf16-true", "fp32 master copy"]),
    "tensor parallel": (lambda d: ["--strategy", "deepspeed_stage_3", "--tp_size", "2"], ["drop --tp_size"]),
    "not installed": (lambda d: ["--strategy", "deepspeed_stage_1"], ["needs the deepspeed package", INSTALL_COMMAND]),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("ds-bad")
    model_file = write_tiny_model(workdir / "tiny.yaml")
    cases = {name: {"argv": resumable_args(model_file, workdir / "out", "--devices", "2", *flags(workdir)),
                    "hide_deepspeed": name == "not installed"}
             for name, (flags, _) in BAD_INPUTS.items()}
    return command_lines(cases, workdir, {**os.environ, **DS_ENV})


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_message_before_any_worker(refusals, case):
    assert_refused(refusals[case], *BAD_INPUTS[case][1])


@needs_deepspeed
@pytest.mark.multiproc
def test_a_deepspeed_checkpoint_resumes_only_where_it_can(reference, tmp_path, model_file):
    """Without DeepSpeed, under ZeRO stage 3 (the checkpoint is stage 2's) or in bf16 (it is fp32's), resume is
    refused in the launching process with the checkpoint's name; QLoRA is refused under any DeepSpeed stage."""
    step = reference / "step-00000004"
    resume = ["--resume", str(step), "--out_dir", str(tmp_path / "out")]
    cases = {
        "stage 3": {"argv": [*resumable_args(model_file, tmp_path / "o"), "--strategy", "deepspeed_stage_3", "--devices",
                             "2", *resume]},
        "bf16": {"argv": [*resumable_args(model_file, tmp_path / "o"), *STRATEGY, "--precision", "bf16-mixed", "--devices",
                          "2", *resume]},
        "without deepspeed": {"argv": [*resumable_args(model_file, tmp_path / "o"), "--devices", "2", *resume]},
        "qlora": {"argv": finetune_args("finetune_lora", reference / "final", tmp_path / "q", "--quantize", "bnb.nf4",
                                        "--precision", "bf16-true", *STRATEGY)},
    }
    results = command_lines(cases, tmp_path, {**os.environ, **DS_ENV})
    assert_refused(results["without deepspeed"], f"--resume {step} was written by DeepSpeed",
                   "on any number of processes")
    assert_refused(results["stage 3"], f"--resume {step} was written under ZeRO stage 1 or 2",
                   "resume with --strategy deepspeed_stage_1 or deepspeed_stage_2")
    assert_refused(results["bf16"], f"--resume {step} was written without bf16", "this run trains in it")
    assert_refused(results["qlora"], "--quantize bnb.nf4 cannot train under --strategy deepspeed_stage_2")


@needs_deepspeed
@pytest.mark.multiproc
def test_a_deepspeed_checkpoint_of_2_processes_resumes_on_1_through_the_universal_checkpoint(reference,
                                                                                            from_reference):
    """The 2-process run's step-4 checkpoint resumed by one process (4 accumulation steps instead of 2): DeepSpeed's
    universal checkpoint gives the one rank the whole fp32 weights and Adam moments, and the losses of steps 5 to 8
    and the final weights are the uninterrupted 2-process run's, to float precision (the sums are taken in
    another order); a lost moment or step would move them by far more. The conversion leaves nothing behind."""
    from llmtrain.checkpoint import files

    step = reference / "step-00000004"
    assert files.read_marker(step)["world_size"] == 2
    result, out_dir, _ = from_reference["one process"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {step} at step 4" in result.stdout
    ours, theirs = losses(out_dir), losses(reference)
    assert sorted(ours) == list(range(5, MAX_STEPS + 1))
    for index in ours:
        assert ours[index] == pytest.approx(theirs[index], rel=1e-5), index
    final, expected = (load_file(str(d / "final" / "model.safetensors")) for d in (out_dir, reference))
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith(".") and p.name != layout.LOCK_FILE) == []


# ------------------------------------------------------------------------------- the config, in-process
def test_auto_values_and_extra_zero_keys_are_accepted(tmp_path):
    """A transformers-style file: "auto" where llmtrain's flags decide, ZeRO's own tuning passed through."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e7,
                              "offload_optimizer": {"device": "cpu"}},
        "communication_data_type": "fp32"}))
    user = read_config(path)
    train = TrainArgs(global_batch_size=16, micro_batch_size=2, max_norm=0.5)
    plan = ParallelPlan.resolve(devices=2, num_nodes=1, train=train, precision="bf16-mixed", strategy="deepspeed",
                                device_type="cuda", zero=zero_settings(user, path))
    config = build_config(plan, train, user, path)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"], config["gradient_clipping"]) == (16, 2, 4, 0.5)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert config["communication_data_type"] == "fp32" and "optimizer" not in config
    assert user["train_batch_size"] == "auto"  # the user's dict is not changed


def test_bf16_accumulates_and_reduces_gradients_in_fp32_unless_the_file_says_otherwise():
    """bf16-mixed: data_types.grad_accum_dtype and communication_data_type fp32 (FSDP's reduce_dtype); a file that
    names either keeps its choice; fp32 runs get neither key. DeepSpeed's own config parser reads them so."""
    train = TrainArgs(global_batch_size=16, micro_batch_size=2)

    def config(precision: str, user: Optional[dict] = None) -> dict:
        plan = ParallelPlan.resolve(devices=2, num_nodes=1, train=train, precision=precision,
                                    strategy="deepspeed_stage_2", device_type="cuda")
        return build_config(plan, train, user)

    bf16 = config("bf16-mixed")
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"} and bf16["communication_data_type"] == "fp32"
    fp32 = config("32-true")
    assert "data_types" not in fp32 and "communication_data_type" not in fp32
    user = {"data_types": {"grad_accum_dtype": "bf16", "param_dtype": "bf16"}, "communication_data_type": "bf16"}
    theirs = config("bf16-mixed", user)
    assert theirs["data_types"] == user["data_types"] and theirs["communication_data_type"] == "bf16"
    assert user["data_types"] == {"grad_accum_dtype": "bf16", "param_dtype": "bf16"}  # the user's dict unchanged
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.runtime.config import DeepSpeedConfig

        parsed = DeepSpeedConfig({**bf16, "train_batch_size": 2, "gradient_accumulation_steps": 1})
        assert (parsed.grad_accum_dtype, parsed.communication_data_type) == ("fp32", torch.float32)


def test_a_file_of_tuning_alone_takes_the_named_strategys_stage_and_offload(tmp_path):
    """What --deepspeed.config leaves out comes from --strategy deepspeed_stage_N; plain --strategy deepspeed needs
    the file's stage, and an offload of parameters below stage 3 is refused."""
    path = tmp_path / "ds.json"
    tuning = {"zero_optimization": {"overlap_comm": True}}
    for name, settings in DEEPSPEED_STRATEGIES.items():
        assert zero_settings(tuning, path, settings) == settings, name
    assert zero_settings({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}}, path,
                         DEEPSPEED_STRATEGIES["deepspeed_stage_3_offload"]).offload_optimizer is False
    with pytest.raises(ValueError, match="sets no zero_optimization.stage"):
        zero_settings(tuning, path)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        zero_settings({"zero_optimization": {"offload_param": {"device": "cpu"}}}, path,
                      DEEPSPEED_STRATEGIES["deepspeed_stage_2"])


def test_deepspeed_is_told_the_gpu_the_rank_took_not_its_local_rank(monkeypatch):
    """A SLURM task that sees only its own GPU (srun --gpus-per-task 1) is local rank 3 on cuda:0; DeepSpeed
    calls set_device(LOCAL_RANK) and puts its ZeRO buffers on cuda:LOCAL_RANK, so LOCAL_RANK must say 0."""
    from types import SimpleNamespace

    from llmtrain.distributed.runtime import Runtime
    from llmtrain_deepspeed import engine

    device_of_engine = []

    def initialize(model, optimizer, config):  # what DeepSpeedEngine._set_distributed_vars reads
        device_of_engine.append(int(os.environ["LOCAL_RANK"]))
        return model, optimizer, None, None

    monkeypatch.setattr(engine, "import_deepspeed", lambda device_type: SimpleNamespace(
        init_distributed=lambda **kwargs: None, initialize=initialize))
    monkeypatch.setenv("LOCAL_RANK", "3")
    runtime = Runtime(rank=3, world_size=4, local_rank=3, local_world_size=4, device=torch.device("cuda", 0))
    model = torch.nn.Linear(2, 2)
    engine.initialize(model, torch.optim.SGD(model.parameters()), {}, runtime)
    assert device_of_engine == [0]
    assert runtime.local_rank == 3  # llmtrain's own local rank (the node's first process tokenizes) is unchanged
