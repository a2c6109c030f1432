"""bench/peers/side_by_side.py: llmtrain, LitGPT and the Trainer in interleaved rounds, end to end with --cpu."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_driver():
    spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "bench/peers/side_by_side.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def row(table: str, workload: str, tool: str) -> list[str]:
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {workload} (") and f"| {tool} |" in line]
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_cpu_mode_runs_each_installed_tool_and_names_the_missing_ones(tmp_path):
    missing = tmp_path / "no-litgpt-venv" / "bin" / "python"
    command = [sys.executable, str(ROOT / "bench/peers/side_by_side.py"), "--cpu", "--rounds", "1", "--steps", "2",
               "--warmup", "1", "--workloads", "pretrain,lora", "--hf_python", sys.executable,
               "--litgpt_python", str(missing), "--out_dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| workload |"):]
    assert "commit" in done.stdout and "torch" in done.stdout  # the header

    peft = importlib.util.find_spec("peft") is not None
    trainer_runs = {"pretrain": True, "lora": peft}
    for workload, trainer_ran in trainer_runs.items():
        ours = row(table, workload, "llmtrain")
        assert float(ours[2].replace(",", "")) > 0 and ours[3].endswith("%") and ours[4].endswith("GB")
        trainer = row(table, workload, "transformers.Trainer")
        if trainer_ran:
            assert float(trainer[2].replace(",", "")) > 0 and trainer[3].endswith("%")
            assert ours[6].endswith("(transformers.Trainer)")  # llmtrain's ratio to the best peer that ran
        else:
            assert trainer[2].startswith("not installed: ") and "lacks peft" in trainer[2]
        litgpt = row(table, workload, "litgpt")
        assert litgpt[2].startswith(f"not installed: no interpreter {missing}") and "litgpt==0.5.13" in litgpt[2]

    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert {(record["workload"], record["tool"]) for record in records} == {
        ("pretrain", "llmtrain"), ("pretrain", "transformers.Trainer"), ("lora", "llmtrain"),
        *([("lora", "transformers.Trainer")] if peft else [])}
    assert all(record["round"] == 1 and record["side_by_side"]["commit"] and record["peak_memory_gb"] > 0
               for record in records)


def test_gpu_workloads_give_every_tool_the_same_shape_batch_precision_and_quantization(tmp_path):
    driver = load_driver()
    args = driver.parse(["--steps", "3", "--warmup", "1"])
    works = {work.name: work for work in driver.workloads(False, args.workloads)}
    assert (works["pretrain"].model, works["pretrain"].micro_batch_size, works["pretrain"].seq_len) == (
        "tiny-llama-1.1b", 4, 2048)
    assert works["pretrain-compiled"].compile and works["qlora"].quantize == "bnb.nf4"
    shape = tmp_path / "Llama-3.2-1B"
    for tool in driver.TOOLS:
        command = driver.tool_command(tool, "python", works["qlora"], shape, args, "cuda", tmp_path, tmp_path / "r")
        assert command[command.index("--quantize") + 1] == "bnb.nf4" and "bf16-true" in command
        assert command[command.index("--micro_batch_size") + 1] == "4" and "2048" in command
        compiled = driver.tool_command(tool, "python", works["pretrain-compiled"], shape, args, "cuda", tmp_path,
                                       tmp_path / "r")
        assert "--compile" in compiled and "--quantize" not in compiled
    litgpt = driver.tool_command("litgpt", "python", works["lora"], shape, args, "cuda", tmp_path, tmp_path / "r")
    assert litgpt[2].endswith("Llama-3.2-1B.json") and litgpt[litgpt.index("--device") + 1] == "cuda"
    assert litgpt[litgpt.index("--lora_targets") + 1] == "query,value"
    assert "not on a CPU" in driver.cannot_run("litgpt", works["qlora"], "cpu")
    assert not driver.cannot_run("litgpt", works["qlora"], "cuda")
