"""``llmtrain download`` with the real huggingface_hub against a Hub on 127.0.0.1 (tests/helpers/local_hub.py).

One tiny Llama, written by transformers (``save_pretrained``, safetensors) with a tokenizer the suite trains, is the
repository; beside the files llmtrain reads it holds pickled weights and others that must not come down. The
downloaded folder then goes straight to ``generate``, ``chat``, ``finetune_lora`` and ``--dry_run``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmtrain.cli import main
from llmtrain.errors import told_status

from conftest import free_port_number
from forked_cli import run_forked
from local_hub import local_hub, write_tiny_llama

REPO = "tiny-org/tiny-llama"
READ = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja"}
"""The repository's files that llmtrain reads, and so the only ones a download may fetch."""
HANG_GUARD_S = 120


def _write_repo(root: Path) -> Path:
    """A transformers folder as the Hub holds it: safetensors weights, tokenizer, chat template, and files llmtrain
    does not read (pickled weights, a README, a subfolder of original weights)."""
    write_tiny_llama(root)
    torch.save({"lm_head.weight": torch.zeros(2)}, root / "pytorch_model.bin")
    (root / "README.md").write_text("# tiny llama\n")
    (root / "original").mkdir()
    torch.save({"w": torch.zeros(2)}, root / "original" / "consolidated.00.pth")
    assert READ <= {p.name for p in root.iterdir()}
    return root


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    tiny = _write_repo(root / "tiny")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tiny / "config.json").read_text())
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    bert = root / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (bert / "model.safetensors").write_bytes(b"not read")
    return {REPO: tiny, "tiny-org/gated-llama": tiny, "old-org/pickled-only": pickled, "bert-org/bert": bert}


@pytest.fixture(scope="module")
def hub(repos):
    with local_hub(repos, gated={"tiny-org/gated-llama"}) as running:
        yield running


@pytest.fixture
def at_hub(hub, monkeypatch, tmp_path):
    """This process downloads from ``hub``, online, with no token of the machine's, into tmp_path."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "llmtrain_cache"))
    monkeypatch.chdir(tmp_path)
    hub.requests.clear()
    return hub


@pytest.fixture(scope="module")
def downloaded(hub, tmp_path_factory):
    """`llmtrain download REPO` once for the module; its folder, stdout and the hub's log."""
    root = tmp_path_factory.mktemp("downloaded")
    hub.requests.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", hub.url)
        patch.setenv("HF_HOME", str(root / "hf_home"))
        patch.delenv("HF_HUB_OFFLINE", raising=False)
        stdout = io.StringIO()
        patch.setattr(sys, "stdout", stdout)
        main(["download", REPO, "--checkpoint_dir", str(root / "checkpoints")])
    return root / "checkpoints" / REPO, stdout.getvalue(), list(hub.requests)


def test_download_fetches_only_what_llmtrain_reads(downloaded, repos):
    folder, stdout, requests = downloaded
    fetched = {p.name for p in folder.iterdir() if p.is_file()}
    assert fetched == READ
    for name in READ:
        assert (folder / name).read_bytes() == (repos[REPO] / name).read_bytes(), name
    asked = {r.path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for r in requests if "/resolve/" in r.path}
    assert asked == READ  # nothing else was even asked for: not the pickles, not the README
    assert f"llmtrain finetune_lora {folder}" in stdout  # the next command


def test_the_downloaded_folder_generates_and_chats(downloaded, tmp_path, monkeypatch, capsys):
    folder, _, _ = downloaded
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    main(["generate", str(folder), "--prompt", "the cat", "--max_new_tokens", "4", "--temperature", "0",
          "--accelerator", "cpu"])
    generated = capsys.readouterr().out.strip()
    assert generated
    monkeypatch.setattr(sys, "stdin", io.StringIO("the dog\n"))
    main(["chat", str(folder), "--max_new_tokens", "3", "--temperature", "0", "--accelerator", "cpu"])
    assert capsys.readouterr().out.strip()
    assert len(list((tmp_path / "cache" / "from_hf").iterdir())) == 2  # converted once (and its lock file)


@pytest.mark.slow
def test_the_downloaded_folder_fine_tunes(downloaded, tmp_path, monkeypatch):
    folder, _, _ = downloaded
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    main(["finetune_lora", str(folder), "--out_dir", str(tmp_path / "lora"), "--train.max_steps", "1",
          "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.max_seq_length", "128",
          "--data", "BuiltinInstruct", "--data.num_train", "8", "--data.num_val", "2", "--eval.max_iters", "1",
          "--accelerator", "cpu"])
    assert (tmp_path / "lora" / "final" / "lora.safetensors").is_file()


def test_a_dry_run_of_the_downloaded_folder_knows_the_model_and_converts_nothing(downloaded, tmp_path, monkeypatch,
                                                                                    capsys):
    folder, _, _ = downloaded
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    main(["finetune_lora", str(folder), "--dry_run", "--out_dir", str(tmp_path / "out")])
    assert "model        custom: 0.1M parameters" in capsys.readouterr().out
    # A zoo architecture is named: a Hub folder of pythia-14m (its config.json, as transformers writes it).
    from llmtrain.config import Config
    from llmtrain.convert import adapter_for_config

    pythia = tmp_path / "checkpoints" / "EleutherAI" / "pythia-14m"
    pythia.mkdir(parents=True)
    config = Config.from_name("pythia-14m")
    (pythia / "config.json").write_text(json.dumps(adapter_for_config(config).hf_config(config)))
    (pythia / "model.safetensors").write_bytes(b"")  # a dry run reads config.json alone
    main(["finetune_full", str(pythia), "--dry_run", "--out_dir", str(tmp_path / "out")])
    assert "model        pythia-14m: 14.1M parameters" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()  # nothing converted or written


def test_a_dropped_connection_resumes_with_a_range_request(repos, at_hub, monkeypatch):
    """huggingface_hub resumes a file whose connection dropped mid-body from the byte it had (``Range``)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)  # bytes land before the drop
    at_hub.drop_once.add("model.safetensors")
    main(["download", REPO])
    file = Path("checkpoints") / REPO / "model.safetensors"
    assert file.read_bytes() == (repos[REPO] / "model.safetensors").read_bytes()
    gets = at_hub.gets("model.safetensors")
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range is not None and gets[1].range.startswith("bytes=") and gets[1].range != "bytes=0-"


def test_a_killed_download_fetches_only_the_rest_when_run_again(repos, hub, tmp_path, monkeypatch, at_hub):
    """The first run is killed while the weights are half sent and the other files are done; the second asks
    for the weights alone and leaves no partial file behind."""
    hub.hold.add("model.safetensors")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "llmtrain", "download", REPO], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        folder = tmp_path / "checkpoints" / REPO
        deadline = time.monotonic() + HANG_GUARD_S
        while not (hub.held.is_set() and all((folder / name).is_file() for name in READ - {"model.safetensors"})):
            assert time.monotonic() < deadline and process.poll() is None, "the first run never got half way"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=HANG_GUARD_S)
    finally:
        process.kill()
        hub.hold.clear()
        hub.release()
    assert not (folder / "model.safetensors").exists()
    hub.requests.clear()
    main(["download", REPO])
    assert (folder / "model.safetensors").read_bytes() == (repos[REPO] / "model.safetensors").read_bytes()
    fetched = {r.path.rsplit("/", 1)[1] for r in hub.gets()}
    assert fetched == {"model.safetensors"}
    assert not list(folder.rglob("*.incomplete"))


def test_a_gated_repository_downloads_with_a_token(at_hub, monkeypatch):
    main(["download", "tiny-org/gated-llama", "--access_token", "hf_test_token"])
    assert (Path("checkpoints") / "tiny-org/gated-llama" / "model.safetensors").is_file()
    assert all(r.authorization == "Bearer hf_test_token" for r in at_hub.gets())
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # or from the environment, as huggingface_hub reads it
    main(["download", "tiny-org/gated-llama", "--checkpoint_dir", "from-env"])
    assert (Path("from-env") / "tiny-org/gated-llama" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def refused(hub, tmp_path_factory):
    """Command lines the hub answers no, each a real `python -m llmtrain` process (forked)."""
    root = tmp_path_factory.mktemp("refused")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf_home"), "OMP_NUM_THREADS": "1"}
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN"):
        env.pop(name, None)
    argvs = {"gated": ["download", "tiny-org/gated-llama"],
             "wrong token": ["download", "tiny-org/gated-llama", "--access_token", "hf_other"],
             "missing": ["download", "tiny-org/no-such-model"],
             "pickled": ["download", "old-org/pickled-only"],
             "unsupported": ["download", "bert-org/bert"],
             "not an id": ["download", "llama"]}
    argvs = {key: [*argv, "--checkpoint_dir", str(root / key.replace(" ", "-"))] for key, argv in argvs.items()}
    done = run_forked(list(argvs.values()), root / "logs", env, timeout_s=HANG_GUARD_S)
    return root, dict(zip(argvs, done))


@pytest.mark.parametrize("case, says", [
    ("gated", ["tiny-org/gated-llama is gated", "--access_token", "HF_TOKEN", "HTTP 401"]),
    ("wrong token", ["is gated", "HTTP 403"]),
    ("missing", ["tiny-org/no-such-model is not a model repository", "HTTP 404"]),
    ("pickled", ["pytorch_model.bin", "never loads", "safetensors"]),
    ("unsupported", ["bert-org/bert cannot be used by llmtrain", "bert"]),
    ("not an id", ["'llama' is not a Hub repository id", "download list"]),
])
def test_a_refused_download_is_one_line_with_exit_2_and_writes_no_weights(refused, case, says):
    root, results = refused
    done = results[case]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    first, hint = done.stderr.strip().splitlines()[-2:]  # after huggingface_hub's progress bars, if any
    assert first.startswith("error: ") and hint.startswith("(")
    for text in says:
        assert text in first, first
    assert not list(root.glob(f"{case.replace(' ', '-')}/**/*.safetensors"))
    assert not list(root.glob(f"{case.replace(' ', '-')}/**/*.bin"))


def test_an_unreachable_hub_is_one_line_at_once(at_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port_number()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(OSError) as refused:
        main(["download", REPO])
    assert time.monotonic() - started < HANG_GUARD_S
    message = str(refused.value)
    assert told_status(refused.value) == 2 and "\n" not in message
    assert "could not reach the Hugging Face Hub" in message and "checkpoints/tiny-org/tiny-llama" in message


def test_offline_mode_refuses_before_asking(at_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=1 forbids reaching the Hugging Face Hub"):
        main(["download", REPO])
    assert at_hub.requests == []


def test_tokenizer_only_and_the_zoo_list(repos, at_hub, capsys):
    main(["download", REPO, "--tokenizer_only", "true"])
    folder = Path("checkpoints") / REPO
    assert {p.name for p in folder.iterdir() if p.is_file()} == READ - {"model.safetensors"}
    assert "--tokenizer_dir checkpoints/tiny-org/tiny-llama" in capsys.readouterr().out
    main(["download", "list"])
    listed = capsys.readouterr().out.split()
    assert "meta-llama/Llama-3.2-1B" in listed and "EleutherAI/pythia-14m" in listed
    assert listed == sorted(listed, key=str.lower)


def test_llm_load_of_a_repo_id_downloads_it_and_answers_as_the_folder(at_hub, tmp_path):
    from llmtrain import LLM

    llm = LLM.load(REPO, accelerator="cpu", precision="32-true")  # at_hub: HF_ENDPOINT is the local hub, cwd tmp_path
    folder = tmp_path / "checkpoints" / REPO
    assert (folder / "config.json").is_file() and any("/resolve/" in r.path for r in at_hub.requests)
    local = LLM.load(folder, accelerator="cpu", precision="32-true")
    assert llm.generate("the cat", 8, temperature=0) == local.generate("the cat", 8, temperature=0)
    with pytest.raises(OSError, match="tiny-org/gated-llama is gated"):  # no token: the download's one line
        LLM.load("tiny-org/gated-llama")
    gated = LLM.load("tiny-org/gated-llama", access_token="hf_test_token", accelerator="cpu", precision="32-true")
    assert gated.generate("the cat", 8, temperature=0) == local.generate("the cat", 8, temperature=0)
