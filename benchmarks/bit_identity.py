"""Behaviour neutrality of a change: short fixed-seed runs of a base commit and of the working tree, every
TensorBoard scalar compared bit for bit.

    python benchmarks/bit_identity.py --base 752006f                          # every case (20 min cold on 2 busy cores)
    python benchmarks/bit_identity.py --base main --cases main,tiny-ppo,tiny-resume
    python benchmarks/bit_identity.py --base 752006f --keep /tmp/bitid       # keep run folders and logs
    python benchmarks/bit_identity.py --base 752006f --no-cache              # rerun the base side too
    python benchmarks/bit_identity.py --list                                  # the cases and their overrides

A refactor is behaviour-neutral when a 3-step float32 run of the main job at a fixed seed logs every TensorBoard
scalar bit-identical to the base, and so do tiny-model runs of every algorithm (PPO with its critic and GAE,
DAPO with dynamic sampling, REINFORCE++ with the KL in the reward), score centering with a correction, the KL
in the loss, a lagged run and a run continued across a resume (``CASES``). For each case this script runs
``recipes/train.py`` twice, in separate processes: with the base commit's code (a temporary
``git worktree add --detach`` of it, its own ``recipes/train.py`` and ``PYTHONPATH=<worktree>/src``; the
worktree is removed at the end) and with the working tree's code, uncommitted changes included. It then reads
both runs' event files and compares every scalar tag except the wall-clock ones (``is_wall_clock``): the same
tags, the same steps in the same order (a base from before steps were numbered from 1 has its steps moved by one
first, ``step_origin``), every value equal bit for bit (NaN equals NaN). It prints one row per
case and exits 1 when a case differs or a run fails, 0 when every case is identical.

Everything that could make two runs differ for reasons other than the code is pinned (``PINNED``): float32
(``trainer.precision=32-true``), torch's own float32 GEMM (``kernels.fp32_gemm=aten``; ``auto`` times the
GEMMs and could pick oneDNN on one side only), a fixed thread count (``threads=2``, the same in
``OMP_NUM_THREADS``; ``auto`` follows the affinity mask, ``adaptive`` the machine's load), ``seed=0``,
``PYTHONHASHSEED=0``, no sample logging, and a run folder of its own under a temporary folder. And torch runs
in its deterministic mode (``BOOTSTRAP``: ``torch.use_deterministic_algorithms(True)`` before the recipe):
without it the main job is not reproducible from run to run on a 2-thread CPU, because the backward of an
advanced-indexing gather (``index_put_`` with accumulate, here the shared-prefix update's ``k[src]`` of each
layer's prompt keys and values) adds into the same gradient rows from both threads with atomic float adds, in
an order that changes between runs, so the weights differ in their last bits after the first update
(measured: 206 of SmolLM2's 272 weight tensors after one step). The tiny model's tensors are below the size at
which torch parallelises that kernel, so its runs were reproducible without it. The tiny-model
cases score completions with ``token_parity`` besides the task's verifier: the random model never answers an
arithmetic question, so with the verifier alone every advantage is 0, the update changes nothing and a broken
update would go unnoticed.

The base side's scalars are cached as JSON in ``$LIT_RL_CACHE/bit_identity/<base sha>/<case>.json``
(``~/.cache/lit_rl`` by default), keyed by the case's commands, the Python and package versions and the CPU,
so a rerun against the same base runs only the working tree's side.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import math
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: scalar tags that measure time, or divide by it (or by a measured peak): never identical between two runs
WALL_CLOCK_PREFIXES = ("time/",)
WALL_CLOCK_TAGS = frozenset(
    {
        "perf/rollout_tokens_per_s",
        "perf/update_tflops",
        "perf/rollout_tflops",
        "perf/peak_tflops",  # the matmul probe's measured peak
        "perf/mfu",
        "perf/threads",  # the thread count, pinned here (threads=2) but excluded by the acceptance rule
        "mfu",
        "tok/s",
    }
)

#: overrides of every run: what could make two runs of the same code differ is fixed
PINNED = (
    "trainer.precision=32-true",
    "kernels.fp32_gemm=aten",
    "seed=0",
    "log.samples_every_n_steps=0",
    "trainer.enable_progress_bar=false",
    "log.plain_lines=true",
)


def token_parity(prompts, completions, completion_ids, **columns) -> list[float]:
    """A reward with spread for the random tiny model (``reward.functions``, TRL's batched form): 1.0 when the
    sum of a completion's token ids is odd, else 0.0. ``completion_ids``: one list of ints per completion.
    About half of each group scores 1, so advantages are nonzero and every update changes the weights."""
    return [float(sum(ids) % 2) for ids in completion_ids]


#: ``python -c BOOTSTRAP <recipe> <args>``: the recipe's OpenMP defaults, torch's deterministic mode (serial
#: instead of atomic-add index_put_ and the like; warn_only: an op without a deterministic kernel warns, and
#: this comparison shows whether it matters), then the recipe as ``__main__``
BOOTSTRAP = """\
import runpy, sys
try:
    from lit_rl.run.hardware import set_omp_defaults
except ImportError:
    try:
        from lit_rl.hardware import set_omp_defaults
    except ImportError:
        set_omp_defaults = None
if set_omp_defaults is not None:
    set_omp_defaults()
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: the reward's source as loaded (read now: an edit of this file during a run must not change the cache key)
_REWARD_SOURCE_SHA = hashlib.sha256(inspect.getsource(token_parity).encode()).hexdigest()[:16]
REWARD_PLACEHOLDER = "<token_parity>"
#: the tiny-model cases' shared overrides (about 1 s a step; ``REWARD_PLACEHOLDER`` becomes this file's path)
TINY = (
    "model=tiny",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "sampling.max_new_tokens=32",
    f"reward.functions=[math,'{REWARD_PLACEHOLDER}']",
    "eval.every_n_steps=2",
    "eval.num_examples=8",
    "eval.batch_size=8",
)


@dataclass(frozen=True)
class Case:
    """One comparison: ``recipes/train.py`` with ``overrides`` (after ``PINNED``) for ``steps`` RL steps; with
    ``resume_at`` it stops after that many steps and is continued in the same folder with ``--resume <folder>
    trainer.max_steps=<steps>``, and the continued run's event files are compared."""

    name: str
    overrides: tuple[str, ...]
    steps: int = 3
    resume_at: int | None = None
    about: str = ""


def _tiny(name: str, *overrides: str, about: str = "", resume_at: int | None = None) -> Case:
    return Case(name, (*TINY, *overrides), resume_at=resume_at, about=about)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "main",
            ("eval.every_n_steps=3", "eval.num_examples=8", "eval.batch_size=8"),
            about="the main job (GRPO, SmolLM2-135M-Instruct, 8 prompts x G=8); eval of 8 prompts after step 3",
        ),
        _tiny("tiny-grpo", "algo=grpo"),
        _tiny("tiny-dr_grpo", "algo=dr_grpo"),
        _tiny("tiny-dapo", "algo=dapo", "algo.dynamic_sampling.enabled=true", about="dynamic sampling, overlong"),
        _tiny("tiny-gspo", "algo=gspo"),
        _tiny("tiny-cispo", "algo=cispo"),
        _tiny("tiny-sapo", "algo=sapo"),
        _tiny("tiny-reinforce", "algo=reinforce", about="RLOO baseline"),
        _tiny("tiny-ppo", "algo=ppo", "algo.value.model=shared", about="critic head, GAE, 2 epochs x 2 minibatches"),
        _tiny("tiny-reinforce_pp", "algo=reinforce_pp", "kl.mode=reward", "kl.beta=0.01", about="KL in the reward"),
        _tiny("tiny-sc-tis", "algo=grpo", "correction=sc+tis", "correction.sc.top_k=32", about="score centering"),
        _tiny("tiny-kl-loss", "algo=grpo", "kl.mode=loss", "kl.beta=0.04", about="KL (k3) in the loss"),
        _tiny("tiny-lagged", "algo=grpo", "rollout.mode=lagged", "rollout.lag=1", about="weights 1 step old"),
        _tiny("tiny-resume", "algo=grpo", resume_at=2, about="the continued run's event files compared"),
    )
}


# -- reading and comparing event files ---------------------------------------------------------------------------
def is_wall_clock(tag: str) -> bool:
    """True for tags left out of the comparison: ``time/*`` and the rates and measured peaks of
    ``WALL_CLOCK_TAGS``. The FLOP counts (``perf/rollout_flops``, ``perf/update_flops``) are compared."""
    return tag.startswith(WALL_CLOCK_PREFIXES) or tag in WALL_CLOCK_TAGS


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under ``run_dir`` (searched recursively).

    Every record is kept, in the order written: files in the order of their first event's wall time (a
    continued run's new file after the first run's), records in file order; a step logged twice appears twice
    (TensorBoard's ``EventAccumulator`` would drop or merge such records). Reads both kinds of scalar summary:
    ``simple_value`` and the scalars plugin's one-element tensors. Values are Python floats (the float32 the
    writer stored, widened exactly). Raises FileNotFoundError when ``run_dir`` holds no event file.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    files = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir}")
    loaded = []
    for path in files:
        events = list(EventFileLoader(str(path)).Load())
        loaded.append((events[0].wall_time if events else 0.0, str(path), events))
    out: dict[str, list[tuple[int, float]]] = {}
    for _, _, events in sorted(loaded, key=lambda x: x[:2]):
        scalar_tensor_tags: set[str] = set()  # the plugin metadata may come with a tag's first record only
        for ev in events:
            for v in ev.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    value = float(v.simple_value)
                elif kind == "tensor":
                    if v.metadata.plugin_data.plugin_name == "scalars":
                        scalar_tensor_tags.add(v.tag)
                    if v.tag not in scalar_tensor_tags:
                        continue
                    arr = tensor_util.make_ndarray(v.tensor)
                    if arr.size != 1:
                        continue
                    value = float(arr.reshape(()))
                else:
                    continue
                out.setdefault(v.tag, []).append((int(ev.step), value))
    return out


def same_value(a: float, b: float) -> bool:
    """Bit-identical as float64 (so -0.0 differs from 0.0), every NaN equal to every NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


@dataclass
class Difference:
    """One way two runs differ: ``kind`` is "value" (``base`` and ``head`` are the values), "steps" (the
    tag's step lists differ from ``step`` on; ``base``/``head`` are the step lists) or "missing" (the tag is in
    one run only; ``base``/``head`` say which: the number of records, or None)."""

    tag: str
    step: int | None
    kind: str
    base: object
    head: object

    def __str__(self) -> str:
        if self.kind == "missing":
            side = "the base" if self.head is None else "the working tree"
            return f"{self.tag}: logged by {side} only"
        if self.kind == "steps":
            return f"{self.tag}: steps {self.base} (base) vs {self.head} (head)"
        return f"{self.tag} @ step {self.step}: {self.base!r} (base) vs {self.head!r} (head)"


@dataclass
class Comparison:
    """The outcome of ``compare_scalars``: ``tags`` compared, ``skipped`` wall-clock tags, ``steps`` distinct
    steps seen among the compared tags, ``records`` (step, value) pairs compared and every difference found."""

    tags: int = 0
    skipped: list[str] = field(default_factory=list)
    steps: int = 0
    records: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def first(self) -> Difference | None:
        """The difference at the earliest step (missing tags and step mismatches first, then by tag name)."""
        if not self.differences:
            return None
        return min(self.differences, key=lambda d: (d.step if d.step is not None else -1, d.tag))


def compare_scalars(base: dict[str, list[tuple[int, float]]], head: dict[str, list[tuple[int, float]]]) -> Comparison:
    """Compare two runs' scalars (``read_scalars``' {tag: [(step, value), ...]}), wall-clock tags
    (``is_wall_clock``) left out: the same tags, for each the same steps in the same order, and every value
    ``same_value``. A value difference is reported per tag at its first differing step."""
    result = Comparison()
    steps: set[int] = set()
    for tag in sorted(set(base) | set(head)):
        if is_wall_clock(tag):
            result.skipped.append(tag)
            continue
        result.tags += 1
        b, h = base.get(tag), head.get(tag)
        if b is None or h is None:
            result.differences.append(
                Difference(tag, None, "missing", None if b is None else len(b), None if h is None else len(h))
            )
            continue
        steps.update(s for s, _ in b)
        b_steps, h_steps = [s for s, _ in b], [s for s, _ in h]
        if b_steps != h_steps:
            at = next((x for x, y in zip(b_steps, h_steps) if x != y), None)
            if at is None:  # one list is a prefix of the other
                at = (b_steps if len(b_steps) > len(h_steps) else h_steps)[min(len(b_steps), len(h_steps))]
            result.differences.append(Difference(tag, at, "steps", b_steps, h_steps))
            continue
        result.records += len(b)
        for (step, x), (_, y) in zip(b, h):
            if not same_value(x, y):
                result.differences.append(Difference(tag, step, "value", x, y))
                break
    result.steps = len(steps)
    return result


#: where a checkout says which number its first RL step is logged under (absent before: 0)
STEP_ORIGIN_FILE = "src/lit_rl/algorithms/step_logging.py"


def first_logged_step(source: str) -> int:
    """The ``FIRST_LOGGED_STEP = N`` that ``source`` (the text of ``STEP_ORIGIN_FILE``) declares; 0 when it has none
    (the code before steps were numbered from 1 logged the first RL step as step 0, and evaluation after step N at
    N - 1)."""
    for line in source.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "FIRST_LOGGED_STEP" and value.strip().isdigit():
            return int(value.strip())
    return 0


def step_origin(sha: str | None) -> int:
    """``first_logged_step`` of the commit ``sha`` (None: the working tree)."""
    if sha is None:
        path = ROOT / STEP_ORIGIN_FILE
        return first_logged_step(path.read_text() if path.exists() else "")
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{sha}:{STEP_ORIGIN_FILE}"], capture_output=True, text=True
    )
    return first_logged_step(shown.stdout if shown.returncode == 0 else "")


def shift_steps(scalars: dict[str, list[tuple[int, float]]], by: int) -> dict[str, list[tuple[int, float]]]:
    """``scalars`` with every step moved by ``by``: a base that numbers steps from 0 compared with a head that
    numbers them from 1 (``step_origin``) is compared step for step, so a value logged one step off still differs."""
    return {tag: [(step + by, value) for step, value in points] for tag, points in scalars.items()}


# -- running a case ----------------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """A training process exited non-zero (or ran past the time limit); the message ends with its log's tail."""


def case_commands(case: Case, threads: int) -> list[list[str]]:
    """The argument lists after ``python <checkout>/recipes/train.py`` of ``case``'s processes (one, or two
    for a resumed case), with the placeholders ``<run>`` (the run folder) and ``REWARD_PLACEHOLDER``."""
    first = [*PINNED, f"threads={threads}", *case.overrides, "hydra.run.dir=<run>"]
    if case.resume_at is None:
        return [[*first, f"trainer.max_steps={case.steps}"]]
    return [[*first, f"trainer.max_steps={case.resume_at}"], ["--resume", "<run>", f"trainer.max_steps={case.steps}"]]


def _fill(args: list[str], run: Path) -> list[str]:
    reward = f"{Path(__file__).resolve()}:{token_parity.__name__}"
    return [a.replace("<run>", str(run)).replace(REWARD_PLACEHOLDER, reward) for a in args]


def child_env(checkout: Path, threads: int) -> dict[str, str]:
    """The environment of a training process run from ``checkout``: its ``src`` first on PYTHONPATH (so its
    own lit_rl is imported, not an installed one), the thread count, hash seed and offline hub pinned."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout / "src"), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONHASHSEED"] = "0"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def check_imports_own_code(python: str, checkout: Path, env: dict[str, str]) -> None:
    """Raise RunFailed unless ``python`` with ``env`` imports lit_rl from ``checkout/src``: an editable
    install of another checkout must not shadow the code under test."""
    out = subprocess.run(
        [python, "-c", "import lit_rl, sys; sys.stdout.write(lit_rl.__file__)"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    where = Path(out.stdout.strip() or "?").resolve()
    if out.returncode != 0 or not where.is_relative_to((checkout / "src").resolve()):
        raise RunFailed(f"{checkout}: lit_rl is imported from {where}, not {checkout / 'src'}: {out.stderr[-400:]}")


def run_logged(argv: list[str], checkout: Path, env: dict[str, str], log: Path, timeout: float, label: str) -> float:
    """Run ``argv`` in ``checkout`` with ``env``, its output appended to ``log`` after the command line (BOOTSTRAP
    abbreviated); prints ``label`` as it starts and ends. Returns its wall seconds; raises RunFailed (a non-zero exit
    or past ``timeout`` seconds) with the log's tail."""
    print(f"  {label}: started", flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(argv).replace(shlex.quote(BOOTSTRAP), '<BOOTSTRAP>')}\n")
        f.flush()
        try:
            proc = subprocess.run(argv, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = f"exit {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout:.0f} s"
    dt = time.perf_counter() - t0
    print(f"  {label}: finished in {dt:.1f} s" + (f" ({rc})" if rc else ""), flush=True)
    if rc:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RunFailed(f"{label}: {rc}; the end of {log}:\n{tail}")
    return dt


def run_case(
    case: Case, side: str, checkout: Path, run: Path, python: str, threads: int, timeout: float
) -> tuple[dict[str, list[tuple[int, float]]], float]:
    """Run ``case`` with ``checkout``'s ``recipes/train.py`` and code in the folder ``run`` (must not exist);
    returns (its scalars, ``read_scalars``; wall seconds of its processes). Each process's output goes to
    ``run``/../<run name>.log. Prints one line as each process starts and ends. Raises RunFailed."""
    env = child_env(checkout, threads)
    log = run.parent / f"{run.name}.log"
    run.parent.mkdir(parents=True, exist_ok=True)
    seconds = 0.0
    commands = case_commands(case, threads)
    for i, args in enumerate(commands, 1):
        argv = [python, "-c", BOOTSTRAP, str(checkout / "recipes" / "train.py"), *_fill(args, run)]
        part = f" part {i}/{len(commands)}" if len(commands) > 1 else ""
        seconds += run_logged(argv, checkout, env, log, timeout, f"{case.name} [{side}]{part}")
    return read_scalars(run), seconds


# -- the base side's cache ---------------------------------------------------------------------------------------
def cache_dir(sha: str) -> Path:
    """``$LIT_RL_CACHE/bit_identity/<sha>`` (``~/.cache/lit_rl`` when LIT_RL_CACHE is unset)."""
    root = Path(os.environ.get("LIT_RL_CACHE", Path.home() / ".cache" / "lit_rl"))
    return root / "bit_identity" / sha


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(case: Case, python: str, threads: int) -> dict:
    """What a cached base result depends on besides the base commit: the case's commands (with placeholders),
    the reward function's source, the interpreter, torch / transformers / lightning / tensorboard versions
    and the CPU. A cache entry whose key differs is not used."""
    versions = {}
    for pkg in ("torch", "transformers", "lightning", "tensorboard", "numpy"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "case": case.name,
        "commands": case_commands(case, threads),
        "bootstrap": BOOTSTRAP,
        "token_parity": _REWARD_SOURCE_SHA,
        "python": os.path.realpath(python),
        "python_version": platform.python_version(),
        "packages": versions,
        "cpu": _cpu_model(),
        "machine": platform.machine(),
    }


def load_cached(path: Path, key: dict) -> tuple[dict[str, list[tuple[int, float]]], float] | None:
    """(scalars, base seconds) cached at ``path`` under ``key``; None when absent, unreadable or keyed
    otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    return {t: [(int(s), float(v)) for s, v in pts] for t, pts in data["scalars"].items()}, float(data["seconds"])


def save_cached(path: Path, key: dict, scalars: dict[str, list[tuple[int, float]]], seconds: float) -> None:
    """Write (key, seconds, scalars) as JSON (floats as repr: exact; NaN and infinities as JSON's extensions),
    through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds, "scalars": scalars}, indent=1))
    os.replace(tmp, path)


# -- git ---------------------------------------------------------------------------------------------------------
def git(*args: str) -> str:
    """stdout of ``git -C ROOT <args>``, stripped; raises SystemExit with git's message on failure."""
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bit_identity: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


@contextlib.contextmanager
def base_checkout(sha: str) -> Iterator[Callable[[], Path]]:
    """Yields a function that returns a checkout of ``sha`` (``git worktree add --detach`` under a temporary
    folder, made on the first call only); the worktree is removed on exit, whatever happened."""
    made: list[Path] = []

    def get() -> Path:
        if not made:
            parent = Path(tempfile.mkdtemp(prefix="lit_rl_bit_identity_base_"))
            git("worktree", "add", "--detach", str(parent / "src"), sha)
            made.append(parent / "src")
        return made[0]

    try:
        yield get
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
            shutil.rmtree(path.parent, ignore_errors=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


# -- the command -------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the final table."""

    case: str
    tags: str = ""
    steps: str = ""
    base_s: str = ""
    head_s: str = ""
    verdict: str = ""
    first: str = ""


def check_case(case: Case, sha: str, base_src: Callable[[], Path], work: Path, args, checked: set[Path]) -> Row:
    """Run (or take from the cache) the base side of ``case``, run the working tree's side, compare. Run
    folders go to ``work/<base|head>/<case>``; ``checked`` holds the checkouts whose imports were verified.
    Raises RunFailed."""
    cache = cache_dir(sha) / f"{case.name}.json"
    key = cache_key(case, args.python, args.threads)
    cached = None if args.no_cache else load_cached(cache, key)
    if cached is not None:
        base, base_s = cached
        print(f"  {case.name} [base]: cached ({cache}; ran {base_s:.1f} s)", flush=True)
        base_col = f"cached ({base_s:.1f})"
    else:
        src = base_src()
        if src not in checked:
            check_imports_own_code(args.python, src, child_env(src, args.threads))
            checked.add(src)
        base, base_s = run_case(case, "base", src, work / "base" / case.name, args.python, args.threads, args.timeout)
        save_cached(cache, key, base, base_s)
        base_col = f"{base_s:.1f}"
    if ROOT not in checked:
        check_imports_own_code(args.python, ROOT, child_env(ROOT, args.threads))
        checked.add(ROOT)
    head, head_s = run_case(case, "head", ROOT, work / "head" / case.name, args.python, args.threads, args.timeout)
    shift = step_origin(None) - step_origin(sha)
    if shift:  # the two sides number steps from different origins: compare step for step all the same
        print(
            f"  {case.name}: base steps moved by {shift:+d} (the base logs its first step as step {step_origin(sha)})"
        )
    c = compare_scalars(shift_steps(base, shift), head)
    return Row(
        case.name,
        f"{c.tags} (+{len(c.skipped)} wall-clock)",
        str(c.steps),
        base_col,
        f"{head_s:.1f}",
        "identical" if c.identical else f"DIFFERS ({len(c.differences)} tags)",
        str(c.first) if c.first else "",
    )


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring). Returns the exit status: 0 when every case is identical, 1 when
    one differs or a run failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the commit (or branch, tag) to compare against")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--keep", type=Path, help="keep the run folders and logs here (<dir>/<base|head>/<case>)")
    ap.add_argument("--no-cache", action="store_true", help="run the base side even when it is cached")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every run (a fixed number)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a training process may run")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of both sides")
    ap.add_argument("--list", action="store_true", help="print the cases and their overrides, run nothing")
    args = ap.parse_args(argv)

    if args.list:
        print(
            f"every run (torch's deterministic mode, OMP_NUM_THREADS={args.threads}, PYTHONHASHSEED=0): "
            f"python recipes/train.py {' '.join(PINNED)} threads={args.threads} hydra.run.dir=<run>"
        )
        print(f"tiny-*: {' '.join(TINY)}")
        for c in CASES.values():
            own = [o for o in c.overrides if o not in TINY] if c.name.startswith("tiny-") else list(c.overrides)
            steps = f"{c.resume_at} steps, then --resume to {c.steps}" if c.resume_at else f"{c.steps} steps"
            print(f"  {c.name}: {' '.join(own) or '(nothing more)'}; {steps}{'; ' + c.about if c.about else ''}")
        return 0
    if not args.base:
        ap.error("--base is required (e.g. --base main)")
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    sha = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    head = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if git("status", "--porcelain") else "")
    print(f"# base {args.base} = {sha[:12]}; working tree {ROOT} at {head}", flush=True)
    print(f"# {_cpu_model()}, {args.threads} threads, python {platform.python_version()}", flush=True)

    work = (args.keep or Path(tempfile.mkdtemp(prefix="lit_rl_bit_identity_"))).resolve()
    taken = [str(work / side / n) for side in ("base", "head") for n in names if (work / side / n).exists()]
    if taken:
        raise SystemExit(f"bit_identity: {taken[0]} exists; give --keep an empty or new folder")
    rows: list[Row] = []
    checked: set[Path] = set()
    t0 = time.perf_counter()
    try:
        with base_checkout(sha) as base_src:
            for n in names:
                try:
                    rows.append(check_case(CASES[n], sha, base_src, work, args, checked))
                except RunFailed as err:
                    print(f"bit_identity: {err}", file=sys.stderr, flush=True)
                    rows.append(Row(n, verdict="FAILED", first=str(err).splitlines()[0]))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n| case | tags compared | steps | base s | head s | verdict | first difference |\n|{'---|' * 7}")
    for r in rows:
        print(f"| {r.case} | {r.tags} | {r.steps} | {r.base_s} | {r.head_s} | {r.verdict} | {r.first} |")
    skipped = sorted(WALL_CLOCK_TAGS | {f"{p}*" for p in WALL_CLOCK_PREFIXES})
    print(f"\nnot compared (wall clock): {', '.join(skipped)}")
    if args.keep:
        print(f"run folders and logs: {work}")
    print(f"base cache: {cache_dir(sha)}; {time.perf_counter() - t0:.0f} s in all")
    bad = [r for r in rows if r.verdict != "identical"]
    if bad:
        print(f"bit_identity: {len(bad)} of {len(rows)} case(s) not identical: {', '.join(r.case for r in bad)}")
        return 1
    print(f"bit_identity: all {len(rows)} case(s) identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
