"""The GPU check (issue 41, docs/scale-out.md "The GPU check"): prepared here, run in one command on a GPU machine.

    scripts/gpu_check.sh --fetch-wheels     # here: the wheels of scripts/gpu_wheels.txt + the tokenizer files
    scripts/gpu_check.sh --dry-run          # here (CPU): the list, the wheels, the configs, the size
    scripts/gpu_check.sh --prove-torch      # here (CPU, several GB from PyPI): fast tests on torch 2.11
    scripts/gpu_check.sh <report folder>    # on the GPU machine: install the wheels, then the stages

The wheels, the tokenizer files and the temporary install live under ``.gpu_check/`` (ignored by git; the device
run carries it). The real mode writes report.md and report.json into the report folder after every stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "scripts" / "gpu_wheels.txt"
WORK = ROOT / ".gpu_check"
WHEELS = WORK / "wheels"
CACHE = WORK / "cache"  # LIT_RL_CACHE on the GPU machine: the tiny model's tokenizer (SmolLM2's), no weights
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
SMOLLM2_FOLDER = "models/HuggingFaceTB--SmolLM2-135M-Instruct"
LIMIT_BYTES = 64 * 2**20  # what travels to the GPU machine: the working tree and the wheels
PYTHON = "3.12"
#: the wheel tags the GPU machine's pip accepts: CPython 3.12 (abi3 included) on manylinux x86_64, glibc <= 2.28
#: (a CUDA 13 machine runs a newer glibc)
PLATFORMS = [f"manylinux_2_{i}_x86_64" for i in range(28, 4, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
TARGET_TAGS = set(tags.cpython_tags((3, 12), platforms=PLATFORMS)) | set(
    tags.compatible_tags((3, 12), "cp312", PLATFORMS)
)
#: the target machine (a wheel's requirement markers are evaluated for it)
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
#: every config the device run composes (tests/test_gpu.py's runs: the tiny model on trainer=gpu)
RUN = [
    "model=tiny",
    "trainer=gpu",
    "trainer.max_steps=2",
    "trainer.enable_progress_bar=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "sampling.max_new_tokens=8",
    "eval.num_examples=4",
    "eval.every_n_steps=2",
    "checkpoint.every_n_steps=2",
]
LORA = ["model.lora.r=4", "algo=reinforce", "algo.baseline=none", "task.constant_reward=1", "optim.lr=1e-3"]
CONFIGS = {"grpo_2_steps": RUN, "lora_2_steps": RUN + LORA}
#: stage name -> (command after the python, timeout in seconds): <= 5 minutes in all
STAGES = {
    "gpu_tests": (["-m", "pytest", "-q", "-s", "-m", "gpu", "tests/test_gpu.py", "-rA"], 160),
    "timings": (["scripts/gpu_timings.py"], 110),
}


def read_list(path: Path = LIST) -> tuple[dict[str, tuple[str, bool]], dict[str, str | None]]:
    """``gpu_wheels.txt`` -> (carried: canonical name -> (version, build from source), present: name -> version or
    None). Raises ValueError naming the line for a line that is neither ``name==version`` nor ``present:``."""
    carried, present = {}, {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("present:"):
            for item in line.removeprefix("present:").split():
                name, _, version = item.partition("==")
                present[canonicalize_name(name)] = version or None
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][A-Za-z0-9.]*)\s*(\[build\])?", line)
        if not m:
            raise ValueError(f"{path.name}:{n}: {raw!r} is not 'name==version' (optionally '[build]')")
        carried[canonicalize_name(m[1])] = (m[2], bool(m[3]))
    return carried, present


def fetch_wheels() -> int:
    """Download (or build, ``[build]``) every carried wheel into .gpu_check/wheels and copy the tokenizer files."""
    carried, _ = read_list()
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    binary = [f"{n}=={v}" for n, (v, build) in carried.items() if not build]
    subprocess.run(
        [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            "--abi",
            "cp312",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_28_x86_64",
            "--dest",
            str(WHEELS),
            *binary,
        ],
        check=True,
    )
    for n, (v, build) in carried.items():
        if build:
            subprocess.run(
                [*pip, "wheel", "--no-deps", "--no-binary", n, "--wheel-dir", str(WHEELS), f"{n}=={v}"], check=True
            )
    from lit_rl.models import cache_dir

    source, target = cache_dir() / SMOLLM2_FOLDER, CACHE / SMOLLM2_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, target / name)
    print(
        f"fetched {len(list(WHEELS.glob('*.whl')))} wheels into {WHEELS.relative_to(ROOT)}; tokenizer files "
        f"into {target.relative_to(ROOT)}"
    )
    return 0


def check_list(carried, present) -> list[str]:
    """Problems of the list itself: torch carried, or a carried version outside pyproject's pin for that name."""
    problems = ["torch must never be carried (the GPU machine's own build is used)"] if "torch" in carried else []
    import tomllib

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for pin in map(Requirement, pins):
        name = canonicalize_name(pin.name)
        if name in carried and not pin.specifier.contains(carried[name][0], prereleases=True):
            problems.append(f"{name}=={carried[name][0]} is outside pyproject's pin {pin}")
    return problems


def wheel_requirements(path: Path) -> list[Requirement]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def check_wheels(carried, present, folder: Path = WHEELS) -> list[str]:
    """Problems of the wheels folder: a carried entry without its wheel (or at another version), a wheel for another
    Python or platform, a wheel not on the list, and a requirement (for Python 3.12 on Linux x86_64, no extras)
    that neither a carried wheel nor the machine's present packages meet."""
    problems, found = [], {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, wheel_tags = parse_wheel_filename(path.name)
        if name not in carried:
            problems.append(f"{path.name}: not on {LIST.name}")
        elif str(version) != str(Version(carried[name][0])):
            problems.append(f"{path.name}: version {version}, the list says {carried[name][0]}")
        if not wheel_tags & TARGET_TAGS:
            problems.append(f"{path.name}: not for CPython {PYTHON} on x86_64 ({', '.join(map(str, wheel_tags))})")
        found[name] = (version, path)
    problems += [f"{n}=={v}: no wheel in {folder}" for n, (v, _) in carried.items() if n not in found]
    for name, (_, path) in found.items():
        for req in wheel_requirements(path):
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue
            dep = canonicalize_name(req.name)
            if dep in found:
                if not req.specifier.contains(found[dep][0], prereleases=True):
                    problems.append(f"{name} needs {req}, carried {dep}=={found[dep][0]}")
            elif dep in present:
                known = present[dep]
                if known is not None and req.specifier and not req.specifier.contains(known, prereleases=True):
                    problems.append(f"{name} needs {req}, the GPU machine has {dep} {known}")
            else:
                problems.append(f"{name} needs {req}: neither carried nor on the GPU machine")
    return problems


def check_configs() -> list[str]:
    """Compose every config of CONFIGS as recipes/train.py does (Hydra over conf/) and validate it."""
    from hydra import compose, initialize_config_dir

    import lit_rl  # noqa: F401  (registers the typed schemas conf/ starts from)
    from lit_rl.config import validate

    problems = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for name, overrides in CONFIGS.items():
            try:
                validate(compose(config_name="train", overrides=overrides))
            except Exception as e:  # noqa: BLE001 - ConfigError, and Hydra's own errors, which name the field
                problems.append(f"config {name}: {type(e).__name__}: {e}")
    return problems


def travelling_bytes() -> tuple[int, int]:
    """(bytes of the files git tracks or would add, bytes of .gpu_check/wheels and .gpu_check/cache): what the
    device run carries (not .gpu_check/site nor --prove-torch's .gpu_check/torch211)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    tree = sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())
    carried = sum(p.stat().st_size for d in (WHEELS, CACHE) for p in d.rglob("*") if p.is_file())
    return tree, carried


def dry_run(lists_only: bool = False) -> tuple[list[str], list[str]]:
    """(report lines, problems): the list, the wheels (unless not fetched, or ``lists_only``), the configs, the
    size. An empty problem list is a pass."""
    carried, present = read_list()
    lines = [f"list: {len(carried)} carried wheels, {len(present)} packages assumed on the GPU machine"]
    problems = check_list(carried, present)
    if lists_only or not WHEELS.is_dir():
        lines.append("wheels: not fetched (scripts/gpu_check.sh --fetch-wheels); folder checks skipped")
    else:
        problems += check_wheels(carried, present)
        lines.append(
            f"wheels: {len(list(WHEELS.glob('*.whl')))} in {WHEELS.relative_to(ROOT)}, checked against the list"
        )
        if not (CACHE / SMOLLM2_FOLDER / "tokenizer.json").is_file():
            problems.append(f"tokenizer files missing under {CACHE.relative_to(ROOT)} (--fetch-wheels copies them)")
    config_problems = check_configs()
    lines.append(f"configs: {len(CONFIGS)} composed and validated ({', '.join(CONFIGS)})")
    tree, extra = travelling_bytes()
    lines.append(
        f"size: working tree {tree / 2**20:.1f} MiB + .gpu_check {extra / 2**20:.1f} MiB = "
        f"{(tree + extra) / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)"
    )
    if tree + extra > LIMIT_BYTES:
        problems.append(f"what travels is {(tree + extra) / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB")
    return lines, problems + config_problems


def machine_facts() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def write_report(folder: Path, report: dict) -> None:
    """report.json and report.md in ``folder``, rewritten after every stage (a stage cut short leaves the rest)."""
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    m = report["machine"]
    md = [
        f"# GPU check, {report['started']}",
        "",
        f"GPU: {m['gpu']}; torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}",
        f"command: `{report['command']}`",
        "",
    ]
    for name, s in report["stages"].items():
        md += [
            f"## {name}: rc {s['rc']} in {s['seconds']:.0f} s (timeout {s['timeout_s']} s)",
            "",
            f"`{s['command']}`",
            "",
            "```",
            s["tail"],
            "```",
            "",
        ]
    for part in ("gpu_tests", "timings"):
        if part in report:
            md += [f"## figures: {part}", "", "```json", json.dumps(report[part], indent=2), "```", ""]
    (folder / "report.md").write_text("\n".join(md))


def device_run(folder: Path) -> int:
    """Install the wheels into .gpu_check/site (no dependencies resolved: the list is the closure), lit_rl from
    src/ on PYTHONPATH (a pip install would fetch pyproject's torch), then every stage with its own timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    site = WORK / "site"
    shutil.rmtree(site, ignore_errors=True)
    wheels = sorted(map(str, WHEELS.glob("*.whl")))
    if not wheels:
        sys.exit(f"no wheels in {WHEELS}: run scripts/gpu_check.sh --fetch-wheels first (where PyPI is reachable)")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(site), *wheels],
        check=True,
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}:{ROOT / 'src'}",
        "LIT_RL_CACHE": str(CACHE),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GPU_CHECK_REPORT": str(folder),
    }
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_facts(),
        "command": "scripts/gpu_check.sh " + str(folder),
        "stages": {},
    }
    worst = 0
    for name, (args, timeout) in STAGES.items():
        t0, cmd = time.perf_counter(), [sys.executable, *args]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
            rc, out = 124, "".join(text) + f"\n(timed out after {timeout} s)"
        report["stages"][name] = {
            "rc": rc,
            "seconds": time.perf_counter() - t0,
            "timeout_s": timeout,
            "command": " ".join(["python", *args]),
            "tail": out[-6000:],
        }
        for part in ("gpu_tests", "timings"):  # the figures the stages wrote (tests/test_gpu.py's report())
            if (folder / f"{part}.json").is_file():
                report[part] = json.loads((folder / f"{part}.json").read_text())
        write_report(folder, report)
        worst = worst or rc
    return worst


#: the tests --prove-torch runs on torch 2.11 (fast ones: the engine, the loss, the config, a tiny recipe run)
PROOF_TESTS = ["tests/test_engine.py", "tests/test_loss.py", "tests/test_config_errors.py", "tests/test_train.py"]


def prove_torch() -> int:
    """The GPU machine's versions on this CPU: a Python 3.12 virtual environment in .gpu_check/torch211 with
    PyPI's torch 2.11 (the CUDA build, several GB, which runs on CPU) and the machine's other packages, the
    carried wheels installed as the device run installs them, then PROOF_TESTS without the slow ones. Needs
    PyPI and python3.12; a separate step (not part of --dry-run) for its size."""
    python = shutil.which("python3.12")
    if python is None:
        sys.exit("--prove-torch needs python3.12 (the GPU machine's Python)")
    venv = WORK / "torch211"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    machine = [
        "torch==2.11.*",
        "lightning==2.6.6",
        "tensorboard",
        "peft",
        "accelerate",
        "pandas",
        "pyarrow",
        "pytest",
        "sympy",
        "jinja2",
        "numpy",
        "pyyaml",
        "regex",
        "tqdm",
        "requests",
        "psutil",
        "typer",
    ]
    subprocess.run([py, "-m", "pip", "install", "--quiet", *machine], check=True)
    wheels = sorted(map(str, WHEELS.glob("*.whl")))
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", *wheels], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LIT_RL_CACHE": str(CACHE), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([py, "-m", "pytest", "-q", "-m", "not slow", *PROOF_TESTS], cwd=ROOT, env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", nargs="?", help="device run: the folder report.md / report.json go to")
    ap.add_argument("--fetch-wheels", action="store_true", help="download the listed wheels (needs PyPI)")
    ap.add_argument("--dry-run", action="store_true", help="check the list, wheels, configs and size (CPU)")
    ap.add_argument("--lists-only", action="store_true", help="with --dry-run: skip the wheels folder (CI)")
    ap.add_argument("--prove-torch", action="store_true", help="the fast tests on torch 2.11 in a CPU venv (GBs)")
    a = ap.parse_args(argv)
    if a.fetch_wheels:
        return fetch_wheels()
    if a.prove_torch:
        return prove_torch()
    if a.dry_run:
        lines, problems = dry_run(a.lists_only)
        print("\n".join(["gpu_check dry run", *(f"  {line}" for line in lines)]))
        print("\n".join(["FAIL:", *(f"  {p}" for p in problems)]) if problems else "PASS")
        return 1 if problems else 0
    if not a.report:
        ap.error("give a report folder (device run), --dry-run or --fetch-wheels")
    return device_run(Path(a.report).resolve())


if __name__ == "__main__":
    sys.exit(main())
