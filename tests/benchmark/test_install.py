"""A non-editable install works on its own: every file llmtrain reads at run time is in the wheel, and the installed
``llmtrain benchmark --short true`` compares with the repository's baseline (package data, not a source-tree path).

Cheap on purpose: the wheel is built without build isolation and installed with ``--no-deps`` into a fresh venv
without pip, whose third-party packages are this interpreter's, seen through a plain path line in a ``.pth`` file. A
plain path line adds that folder to ``sys.path`` without running the ``.pth`` files in it, so the editable install's
finder there is not installed and ``llmtrain`` is the fresh venv's copy (asserted).
"""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llmtrain.benchmark.baseline import baseline_key

ROOT = Path(__file__).resolve().parents[2]
# The packages the wheel ships (pyproject.toml's [tool.setuptools.packages.find]), as folders of the source tree.
PACKAGES = (ROOT / "llmtrain", ROOT / "extensions" / "deepspeed" / "llmtrain_deepspeed")
# Hang guards, ten times what each step takes on a busy 2-core machine (build 15 s, benchmark 40 s).
BUILD_TIMEOUT_S, BENCHMARK_TIMEOUT_S = 300, 600


def source_files(package: Path) -> dict[str, bytes]:
    """The package's files as a wheel names them (``llmtrain/benchmark/baseline.json``), without bytecode."""
    return {path.relative_to(package.parent).as_posix(): path.read_bytes() for path in sorted(package.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def build_wheel(out: Path) -> Path:
    """A wheel of a copy of the packaging inputs (building in the source tree would leave build/ and egg-info)."""
    source = out / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(package, source / package.relative_to(ROOT), ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--wheel-dir", str(out / "dist"), str(source)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (wheel,) = (out / "dist").glob("llmtrain-*.whl")
    return wheel


def fresh_venv(directory: Path, wheel: Path) -> Path:
    """A venv with ``wheel`` installed (no dependencies) and this interpreter's site-packages on its path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=BUILD_TIMEOUT_S)
    python = directory / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "third_party.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    return python


@pytest.mark.slow
def test_a_non_editable_install_ships_its_data_and_benchmarks_against_the_repositorys_baseline(tmp_path):
    wheel = build_wheel(tmp_path / "build")
    shipped = zipfile.ZipFile(wheel).namelist()
    for package in PACKAGES:  # every non-Python file of the packages is package data (pyproject.toml)
        missing = [name for name in source_files(package) if name not in shipped]
        assert not missing, f"files of {package.name} that the wheel lacks: {missing}"

    venv = tmp_path / "fresh"
    python = fresh_venv(venv, wheel)
    # Without PYTHONPATH (which the suite may set to a source tree), from a folder that holds no llmtrain.
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", LLMTRAIN_CACHE_DIR=str(tmp_path / "cache"))  # one thread, as the baseline's runs
    where = subprocess.run([str(python), "-c", "import llmtrain, llmtrain_deepspeed, llmtrain.benchmark.baseline as b;"
                            "print(llmtrain.__file__); print(llmtrain_deepspeed.__file__); print(b.DEFAULT_BASELINE)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    llmtrain_file, deepspeed_file, baseline_file = map(Path, where.stdout.split())
    for path in (llmtrain_file, deepspeed_file, baseline_file):
        assert path.is_relative_to(venv), (path, venv)  # the installed copy, not the source tree
    assert baseline_file.read_bytes() == (ROOT / "llmtrain" / "benchmark" / "baseline.json").read_bytes()

    done = subprocess.run([str(venv / "bin" / "llmtrain"), "benchmark", "--short", "true", "--out_dir",
                           str(tmp_path / "bench")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=BENCHMARK_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "bench" / "benchmarks.jsonl").read_text().splitlines()]
    if baseline_key(record) in json.loads(baseline_file.read_text()):  # this machine has a number in the repository
        assert f"tokens/s vs baseline: {record['baseline_ratio']:.2f}x" in done.stdout, done.stdout[-2000:]
    else:  # looked up in the installed copy's file, then recorded in the machine's own
        assert "is now the baseline" in done.stdout and str(baseline_file) in done.stdout, done.stdout[-2000:]
