"""scripts/gpu_check.sh's dry run (what CI runs: the list, the configs, the size) and the gpu tests' skip without
CUDA. The wheels folder itself is checked by ``scripts/gpu_check.sh --dry-run`` after ``--fetch-wheels``."""

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from helpers import ROOT

SCRIPT = f"{ROOT}/scripts/gpu_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_runs_list_config_and_size_checks_pass(check):
    lines, problems = check.dry_run(lists_only=True)
    assert problems == []
    assert any(line.startswith("configs: 2 composed and validated") for line in lines), lines
    assert any(line.startswith("size: ") for line in lines), lines


def test_the_check_validates_the_configs_the_gpu_tests_run(check):
    import test_gpu

    assert check.CONFIGS == {"grpo_2_steps": test_gpu.RUN, "lora_2_steps": test_gpu.RUN + test_gpu.LORA}


def test_the_list_carries_the_engines_transformers_and_never_torch(check):
    carried, present = check.read_list()
    assert carried["transformers"] == ("5.24.0", False) and "torch" not in carried
    assert carried["antlr4-python3-runtime"] == ("4.9.3", True)  # sdist only on PyPI: built into a wheel
    assert present["torch"] == "2.11" and check.check_list(carried, present) == []
    bad = {**carried, "torch": ("2.13.0", False), "hydra-core": ("1.3.2", False)}
    assert check.check_list(bad, present) == [
        "torch must never be carried (the GPU machine's own build is used)",
        "hydra-core==1.3.2 is outside pyproject's pin hydra-core==1.3.8",
    ]


def fake_wheel(folder, filename, requires=()):
    name, version = filename.split("-")[:2]
    with zipfile.ZipFile(folder / filename, "w") as z:
        meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{meta}")


def test_the_wheel_check_names_a_missing_wheel_a_wrong_version_a_wrong_python_and_an_unmet_requirement(check, tmp_path):
    carried = {"a": ("1.0", False), "b": ("2.0", False), "c": ("3.0", False), "d": ("1.0", False)}
    present = {"numpy": None, "torch": "2.11"}
    fake_wheel(
        tmp_path, "a-1.0-py3-none-any.whl", ["b>=2", "numpy", "torch>=2.12", "zzz", "win; sys_platform == 'win32'"]
    )
    fake_wheel(tmp_path, "b-2.0-cp312-cp312-manylinux2014_x86_64.whl", ["a<1"])
    fake_wheel(tmp_path, "c-3.1-py3-none-any.whl")
    fake_wheel(tmp_path, "d-1.0-cp311-cp311-manylinux2014_x86_64.whl")
    assert check.check_wheels(carried, present, tmp_path) == [
        "c-3.1-py3-none-any.whl: version 3.1, the list says 3.0",
        "d-1.0-cp311-cp311-manylinux2014_x86_64.whl: not for CPython 3.12 on x86_64 (cp311-cp311-manylinux2014_x86_64)",
        "a needs torch>=2.12, the GPU machine has torch 2.11",
        "a needs zzz: neither carried nor on the GPU machine",
        "b needs a<1, carried a==1.0",
    ]


def test_every_name_the_gpu_tests_import_exists_here():
    """The gpu tests import inside their bodies (they are skipped here): every such import must resolve."""
    with open(f"{ROOT}/tests/test_gpu.py") as f:
        tree = ast.parse(f.read())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert len(imports) > 10
    for node in imports:
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name), f"{node.module}.{alias.name}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_without_cuda_every_gpu_test_is_marked_gpu_and_skipped_with_a_reason():
    import test_gpu

    tests = [name for name in dir(test_gpu) if name.startswith("test_")]
    assert len(tests) == 7
    marks = {m.name: m for m in test_gpu.pytestmark}
    assert "gpu" in marks
    skip = marks["skipif"]
    assert skip.args == (True,) and "CUDA" in skip.kwargs["reason"]


def test_the_report_names_the_machine_each_stage_and_the_figures(check, tmp_path):
    report = {
        "started": "2026-12-02 17:00 UTC",
        "command": "scripts/gpu_check.sh out",
        "machine": {"gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "python": "3.12.3", "host": "h"},
        "stages": {
            "gpu_tests": {"rc": 0, "seconds": 61.2, "timeout_s": 160, "command": "python -m pytest", "tail": "7 passed"}
        },
        "gpu_tests": {"precision_auto": "bf16-mixed"},
    }
    check.write_report(tmp_path, report)
    md = (tmp_path / "report.md").read_text()
    assert "GPU: NVIDIA H200; torch 2.11.0, CUDA 13.0, Python 3.12.3" in md
    assert "## gpu_tests: rc 0 in 61 s (timeout 160 s)" in md and "7 passed" in md
    assert '"precision_auto": "bf16-mixed"' in md
    assert json.loads((tmp_path / "report.json").read_text()) == report


def test_the_stages_fit_five_minutes(check):
    assert sum(timeout for _, timeout in check.STAGES.values()) <= 300 - 20  # 20 s for installing the wheels


@pytest.mark.slow
def test_the_timing_stage_runs_on_cpu_at_the_smoke_layout(tmp_path):
    """scripts/gpu_timings.py --smoke (~90 s on 2 cores, ~100 s with trl): the timing code end to end on CPU."""
    env = {**os.environ, "GPU_CHECK_REPORT": str(tmp_path)}
    subprocess.run([sys.executable, f"{ROOT}/scripts/gpu_timings.py", "--smoke"], env=env, check=True, timeout=600)
    result = json.loads((tmp_path / "timings.json").read_text())
    assert result["smoke"] and sorted(result["models"]) == ["Qwen3-0.6B-shaped", "SmolLM2-135M"]
    for m in result["models"].values():
        assert m["generated_tokens"] == 2 * 2 * 8  # no stop token: every completion runs to max_new_tokens
        assert m["step_s"] == pytest.approx(m["rollout_s"] + m["update_s"]) and 0 < m["mfu_vs_nominal"]
    trl = result["trl_grpo_trainer"]  # TRL's GRPOTrainer on the same layout where trl is installed
    assert trl == "trl not installed (scripts/gpu_wheels.txt carries it)" or trl["generated_tokens"] == 2 * 2 * 8


def probe_wheel(folder):
    """A real, installable wheel of one module (``gpucheckprobe.VALUE = 7``)."""
    path = folder / "gpucheckprobe-1.0-py3-none-any.whl"
    info = "gpucheckprobe-1.0.dist-info"
    files = {
        "gpucheckprobe.py": "VALUE = 7\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheckprobe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return path


def test_the_device_run_installs_the_wheels_and_runs_each_stage_under_its_own_timeout(check, tmp_path, monkeypatch):
    """The device mode's orchestration on CPU with stand-in stages: the wheels installed into the target and
    importable beside lit_rl from src/, a stage past its timeout reported as rc 124, the report written."""
    monkeypatch.setattr(check, "WORK", tmp_path / "work")
    monkeypatch.setattr(check, "WHEELS", tmp_path / "work" / "wheels")
    check.WHEELS.mkdir(parents=True)
    probe_wheel(check.WHEELS)
    probe = "import gpucheckprobe, lit_rl.config; print('probe', gpucheckprobe.VALUE)"
    stages = {"probe": (["-c", probe], 60), "hang": (["-c", "import time; time.sleep(60)"], 2)}
    monkeypatch.setattr(check, "STAGES", stages)
    assert check.device_run(tmp_path / "out") == 124
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["stages"]["probe"]["rc"] == 0 and "probe 7" in report["stages"]["probe"]["tail"]
    assert report["stages"]["hang"]["rc"] == 124 and "timed out after 2 s" in report["stages"]["hang"]["tail"]
    assert (tmp_path / "out" / "report.md").is_file()
