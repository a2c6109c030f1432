"""--profile: the window and its checks, the profiler inside fit(), and the real CLI writing traces and tables."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.args import EvalArgs, ProfileArgs, TrainArgs, batch_plan
from llmtrain.cli import main
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.recipes import prepare as prepare_module
from llmtrain.callbacks import Callback
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, fit
from llmtrain.precision import Precision
from llmtrain.train.profile import StepProfiler, build_profiler, takes_memory_snapshot

from conftest import ListLoader, TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMALL_DATA = ["--data.num_documents", "400", "--data.num_val_documents", "40"]


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    """One cache for the module: the built-in tokenizer and token files are made once."""
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


def tiny_args(model_file, out_dir, *extra):
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            *SMALL_DATA, "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_seq_length", "32", "--train.lr_warmup_steps", "1", "--eval.max_iters", "1", *extra]


def trace_steps(path: Path) -> list[str]:
    """The names of the profiler's step spans in a Chrome trace (`ProfilerStep#N`, one per recorded step)."""
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#"))


# ---- the window --------------------------------------------------------------------------------------
def test_a_window_is_checked_when_the_flags_are_parsed():
    with pytest.raises(ValueError, match=r"--profile.start_step must be at least 1 \(steps count from 1\), got 0"):
        ProfileArgs(start_step=0)
    with pytest.raises(ValueError, match=r"--profile.end_step 2 is before --profile.start_step 3; .*use "
                                         r"--profile.end_step 3 or later"):
        ProfileArgs(start_step=3, end_step=2)


def test_any_profile_flag_turns_profiling_on():
    assert not ProfileArgs().requested and not ProfileArgs(enabled=False).requested
    for args in (ProfileArgs(enabled=True), ProfileArgs(start_step=5), ProfileArgs(end_step=5),
                 ProfileArgs(record_shapes=True), ProfileArgs(memory=False), ProfileArgs(with_stack=True)):
        assert args.requested, args


def test_the_default_window_is_three_steps_from_the_second_step_of_this_run():
    bare = ProfileArgs(enabled=True)
    assert bare.window(first_step=1, last_step=300) == (2, 4)
    assert bare.window(first_step=101, last_step=300) == (102, 104)  # resumed after step 100
    assert bare.window(first_step=1, last_step=2) == (2, 2)  # a short run shortens it
    assert bare.window(first_step=1, last_step=1) == (1, 1)
    assert ProfileArgs(start_step=10).window(1, 300) == (10, 12)
    assert ProfileArgs(start_step=299).window(1, 300) == (299, 300)
    assert ProfileArgs(end_step=1).window(1, 300) == (1, 1)
    assert ProfileArgs(start_step=5, end_step=9).window(101, 300) == (5, 9)  # given steps are kept as given


def test_a_window_past_the_last_step_names_the_limit_that_sets_it():
    with pytest.raises(ValueError, match=r"--profile.start_step 500 is past the run's last step, 300 "
                                         r"\(--train.max_steps 300\): profile steps within 1-300, or train longer"):
        ProfileArgs(start_step=500).check_within(300, "--train.max_steps 300")
    with pytest.raises(ValueError, match="--profile.end_step 301 is past"):
        ProfileArgs(start_step=300, end_step=301).check_within(300, "--train.max_steps 300")
    ProfileArgs(start_step=300, end_step=300).check_within(300, "--train.max_steps 300")


def test_a_resumed_run_profiles_what_is_left_of_the_window_and_says_so(tmp_path):
    said = []
    done = build_profiler(ProfileArgs(start_step=5, end_step=7), tmp_path, 0, CPU, first_step=11, last_step=300,
                          say=said.append)
    assert done is None  # a warning, not an error: a requeued job reruns the same command with --resume auto
    assert said == ["--profile: steps 5-7 were trained before this run resumed after step 10; nothing is profiled"]
    partial = build_profiler(ProfileArgs(start_step=5, end_step=12), tmp_path, 0, CPU, first_step=11,
                             last_step=300, say=said.append)
    assert partial.window == range(11, 13) and partial.warmup == 0  # no step of this run comes before it
    assert said[1] == "--profile: this run resumes after step 10; profiling steps 11-12 of 5-12"
    fresh = build_profiler(ProfileArgs(enabled=True), tmp_path, 3, CPU, first_step=1, last_step=300,
                           say=said.append)
    assert fresh.window == range(2, 5) and fresh.warmup == 1 and len(said) == 2
    assert fresh.trace_path == tmp_path / "profile" / "rank3.json"


def test_a_memory_snapshot_is_taken_on_cuda_only():
    assert takes_memory_snapshot(ProfileArgs(enabled=True), CUDA)
    assert not takes_memory_snapshot(ProfileArgs(enabled=True), CPU)
    assert not takes_memory_snapshot(ProfileArgs(memory=False), CUDA)


# ---- the profiler inside fit() ---------------------------------------------------------------------------
def tiny_fit(profiler: StepProfiler, max_steps: int) -> Fit:
    """A 2-layer model trained on random tokens for ``max_steps`` steps of 2 samples, with ``profiler``."""
    torch.manual_seed(0)
    config = Config(**{**TINY_MODEL, "vocab_size": 64, "block_size": 8})
    model = GPT(config)
    model.init_weights()
    samples = [(torch.randint(0, 64, (8,)), torch.randint(0, 64, (8,))) for _ in range(8)]
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=max_steps, lr_warmup_steps=0,
                      save_interval=None)
    return Fit(runtime=Runtime(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               train_loader=ListLoader(samples, 2), val_loader=None, train=train,
               eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
               horizon=plan_horizon(train, 16, None), precision=Precision("32-true"),
               save_checkpoint=lambda state: None, save_final=lambda state: None, callbacks=[profiler])


def test_the_window_is_recorded_and_written_when_its_last_step_ends(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **k: pytest.fail("a memory history on the CPU"))
    profiler = StepProfiler(ProfileArgs(enabled=True), range(2, 4), warmup=1, directory=tmp_path, rank=0, device=CPU)
    written_at = []
    real_write = profiler._write
    monkeypatch.setattr(profiler, "_write", lambda prof: (written_at.append(job.state.step), real_write(prof)))
    job = tiny_fit(profiler, max_steps=4)
    fit(job)
    assert written_at == [3]  # at the end of step 3, not at the end of the run
    assert trace_steps(tmp_path / "rank0.json") == ["ProfilerStep#1", "ProfilerStep#2"]  # step 1 was warmup
    table = (tmp_path / "operators_rank0.txt").read_text()
    assert "Self CPU time total" in table and "aten::" in table
    printed = capsys.readouterr().out
    assert f"profile of steps 2-3 in {tmp_path}" in printed and table.strip() in printed
    assert "memory_rank" not in printed and not list(tmp_path.glob("*.pickle"))


def test_a_run_that_stops_inside_the_window_writes_what_it_recorded(tmp_path):
    profiler = StepProfiler(ProfileArgs(enabled=True), range(1, 6), warmup=0, directory=tmp_path, rank=0, device=CPU)
    with pytest.warns(UserWarning, match="warmup"):  # torch's word: nothing before step 1 warms the profiler up
        fit(tiny_fit(profiler, max_steps=2))
    # steps 1 and 2, then the run's end (its final checkpoint) up to the stop
    assert trace_steps(tmp_path / "rank0.json") == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert profiler.profiler is None


def test_on_cuda_the_window_also_leaves_a_memory_snapshot(tmp_path, monkeypatch):
    """The CUDA calls, faked (no GPU here): history on at the window's start, the snapshot, history off."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    profiler = StepProfiler(ProfileArgs(enabled=True), range(2, 3), warmup=1, directory=tmp_path, rank=1,
                            device=CUDA)
    with pytest.warns(UserWarning, match="CUDA is not available"):  # the model runs on the CPU here
        fit(tiny_fit(profiler, max_steps=3))
    assert calls == [("record", {"max_entries": 100_000}), ("dump", str(tmp_path / "memory_rank1.pickle")),
                     ("record", {"enabled": None})]
    assert trace_steps(tmp_path / "rank1.json") == ["ProfilerStep#1"]


def test_an_out_of_memory_error_inside_the_window_still_leaves_the_snapshot(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))

    class OutOfMemoryAtStep2(Callback):
        def on_step_start(self, step):
            if step == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    profiler = StepProfiler(ProfileArgs(start_step=1, end_step=3), range(1, 4), warmup=0, directory=tmp_path,
                            rank=0, device=CUDA)
    job = tiny_fit(profiler, max_steps=3)
    job.callbacks.append(OutOfMemoryAtStep2())
    with pytest.raises(torch.cuda.OutOfMemoryError), pytest.warns(UserWarning):
        fit(job)
    assert [call[0] for call in calls] == ["record", "dump", "record"]
    assert trace_steps(tmp_path / "rank0.json")  # step 1, and step 2 up to the error


# ---- the command line ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--profile.start_step", "500"], r"--profile.start_step 500 is past the run's last step, 300 "
                                      r"\(--train.max_steps 300\)"),
    (["--profile.start_step", "250", "--profile.end_step", "301"], "--profile.end_step 301 is past"),
    (["--train.max_tokens", "1280", "--profile"], None),  # 128 tokens per step: 10 steps, the default window fits
    (["--train.max_tokens", "1280", "--profile.end_step", "11"],
     r"--profile.end_step 11 is past the run's last step, 10 \(--train.max_tokens 1280\)"),
    (["--profile.start_step", "0"], "--profile.start_step must be at least 1"),
    (["--profile.start_step", "3", "--profile.end_step", "2"], "--profile.end_step 2 is before"),
])
def test_a_bad_window_is_refused_before_the_launch(flags, message, tmp_path, tiny_model_file, monkeypatch):
    launched = []
    monkeypatch.setattr(prepare_module, "launch", lambda fn, args, **kw: launched.append(args[0]))
    argv = tiny_args(tiny_model_file, tmp_path / "o", "--train.max_steps", "300", *flags)
    if message is None:
        main(argv)
        assert launched[0].profile == ProfileArgs(enabled=True)
        return
    with pytest.raises(ValueError, match=message):
        main(argv)
    assert not launched and not (tmp_path / "o").exists()


def test_without_profile_flags_the_ranks_get_no_profiler_settings(tmp_path, tiny_model_file, monkeypatch):
    launched = []
    monkeypatch.setattr(prepare_module, "launch", lambda fn, args, **kw: launched.append(args[0]))
    main(tiny_args(tiny_model_file, tmp_path / "o", "--train.max_steps", "3"))
    assert launched[0].profile is None  # so run() builds no profiler


def test_finetuning_checks_the_window_against_max_steps_though_epochs_wait_for_the_data(tmp_path, monkeypatch):
    from llmtrain.checkpoint.layout import CONFIG_FILE

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    Config.from_name("llama-debug").save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")  # nothing reads them before the launch
    monkeypatch.setattr(prepare_module, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"--profile.start_step 500 is past the run's last step, 300 "
                                         r"\(--train.max_steps 300\)"):
        main(["finetune_lora", str(model_dir), "--out_dir", str(tmp_path / "o"), "--train.max_steps", "300",
              "--profile.start_step", "500"])


def test_a_run_sized_by_epochs_is_checked_once_the_data_is_read(tmp_path, tiny_model_file, monkeypatch):
    import llmtrain.recipes.build as build

    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("model built before the check"))
    with pytest.raises(ValueError, match=r"--profile.start_step 100000 is past the run's last step, \d+ "
                                         r"\(--train.epochs 0.01\)"):
        main(tiny_args(tiny_model_file, tmp_path / "o", "--train.epochs", "0.01", "--profile.start_step", "100000"))


def test_the_issue_example_exits_2_with_one_message(tmp_path):
    out_dir = tmp_path / "o"
    command = [sys.executable, "-m", "llmtrain", "pretrain", "--config", "config_hub/pretrain/debug.yaml",
               "--train.max_steps", "300", "--profile.start_step", "500", "--out_dir", str(out_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: --profile.start_step 500 is past the run's last step, 300 "
                                    "(--train.max_steps 300)")
    assert "Traceback" not in result.stderr and not out_dir.exists()


@pytest.mark.slow
def test_debug_recipe_writes_a_trace_and_prints_the_table(tmp_path, capsys):
    out_dir = tmp_path / "out"
    main(["pretrain", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--data.max_bytes", "2000000",
          "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
          "--eval.max_iters", "1", "--train.max_steps", "3", "--profile.start_step", "2", "--profile.end_step", "3",
          "--out_dir", str(out_dir)])
    profile = out_dir / "profile"
    assert sorted(path.name for path in profile.iterdir()) == ["operators_rank0.txt", "rank0.json"]
    assert trace_steps(profile / "rank0.json") == ["ProfilerStep#1", "ProfilerStep#2"]
    table = (profile / "operators_rank0.txt").read_text()
    printed = capsys.readouterr().out
    assert "Self CPU time total" in table and table.strip() in printed


def test_two_ranks_write_a_trace_each(tmp_path, tiny_model_file, dist_env, tmp_path_factory):
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))
    out_dir = tmp_path / "out"
    command = [sys.executable, "-m", "llmtrain", *tiny_args(tiny_model_file, out_dir, "--devices", "2",
                                                            "--train.max_steps", "2", "--profile")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert trace_steps(out_dir / "profile" / f"rank{rank}.json") == ["ProfilerStep#1"]  # the default: step 2
        assert (out_dir / "profile" / f"operators_rank{rank}.txt").is_file()
    assert result.stdout.count("Self CPU time total") == 1  # rank 0 prints; the others write
