"""Run a preset's sweep one job at a time, each job its own command (so each can take a CPU lock of its own).

    python recipes/study.py experiment=staleness_sweep --out outputs/staleness --wrap "cpulock shared"
    python recipes/study.py experiment=constant_reward_drift seed=0,1,2 --out outputs/drift --dry-run

Hydra's ``-m`` runs a sweep's jobs inside one process, so a wrapper around the command (a CPU lock, a job
scheduler's ``srun``) holds for the whole sweep. This runner expands the same grid — the preset's
``hydra.sweeper.params`` and any ``key=a,b,c`` sweep on the command line, parsed by Hydra's own override
parser — and starts ``recipes/train.py`` once per job with ``hydra.run.dir=<out>/<name>``, the name being
the swept ``key=value`` items joined by "," as a multirun names its folders (``correction=sc,seed=1``), so
``recipes/compare.py <out>`` reads the result as a sweep and groups the seeds. Jobs run seed by seed (every
setting's seed 0 first), so a study stopped early holds whole seeds; a job whose folder holds
``finished.json`` is skipped, and one with checkpoints but no ``finished.json`` is continued with
``recipes/train.py --resume <folder>`` (its saved config, its last checkpoint: docs/reliability.md). Each
job's wall time goes to ``<out>/study_log.tsv``. ``--drop-weights`` deletes a finished job's checkpoints and
exported policy (what fills a disk: 40 SmolLM2-135M jobs keep ~64 GB of them), keeping what compare.py reads.
"""

from __future__ import annotations

import itertools
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Job:
    """One run of the sweep: its folder name and the overrides that make it (swept, then fixed)."""

    name: str
    overrides: list[str]


def sweep_values(arg: str) -> tuple[str, list[str]] | None:
    """(key, [values as override strings]) of a sweep override ``key=a,b`` (Hydra's parser: ranges, globs and
    quoted commas included); None for an override that sweeps nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (o,) = OverridesParser.create().parse_overrides([arg])
    if not o.is_sweep_override():
        return None
    return o.key_or_group, [str(v) for v in o.sweep_string_iterator()]


def expand(preset_params: dict[str, str], args: list[str]) -> list[Job]:
    """The jobs of a sweep: ``preset_params`` ({key: "a,b"} from ``hydra.sweeper.params``) and the command
    line ``args`` (sweeps override the preset's same key, and so does a single value of it, which stays in the
    jobs' names; other overrides go to every job). Jobs are ordered
    seed by seed (``seed`` outermost), then in the grid's order with the preset's keys first."""
    grid: dict[str, list[str]] = {}
    for key, value in preset_params.items():
        parsed = sweep_values(f"{key}={value}")
        grid[key] = parsed[1] if parsed else [str(value)]
    fixed = []
    for arg in args:
        parsed = sweep_values(arg)
        key = arg.split("=", 1)[0].lstrip("+~")
        if parsed is None and key in grid:
            # a fixed value of a key the preset sweeps: that one value, still named, so that a study split over
            # commands (seed=0,1 in one, seed=2 in another) names its folders alike in one --out
            grid[key] = [arg.split("=", 1)[1]]
        elif parsed is None:
            fixed.append(arg)
        else:
            grid[parsed[0]] = parsed[1]
    from ..run.runfolder import job_folder_name

    keys = list(grid)
    seeds = grid.pop("seed", None)
    keys = [k for k in keys if k != "seed"]
    jobs = []
    for seed in seeds or [None]:
        for combo in itertools.product(*(grid[k] for k in keys)):
            items = [f"{k}={v}" for k, v in zip(keys, combo)] + ([f"seed={seed}"] if seed is not None else [])
            jobs.append(Job(job_folder_name(items), fixed + items))  # one level: "/" in a value is %2F
    return jobs


def run_dir_override(folder) -> str:
    """``hydra.run.dir="<folder>"``: the folder as a quoted string in Hydra's override grammar (a sweep job's
    name holds ``=`` and ``,``, which unquoted would parse as a sweep), as ``recipes/train.py --resume`` does."""
    return "hydra.run.dir=" + repr(str(folder)).replace("\\\\", "\\")


def preset_params(overrides: list[str]) -> dict[str, str]:
    """``hydra.sweeper.params`` of the config the overrides compose (the experiment preset's sweep)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    fixed = [a for a in overrides if sweep_values(a) is None]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=fixed, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params")  # hydra.sweeper is Hydra's node, not ours: None without a preset
    params = OmegaConf.to_container(params) if params is not None else {}
    return {k: str(v) for k, v in params.items()}


def invalid_jobs(jobs: list[Job]) -> list[tuple[Job, str]]:
    """(job, first line of its error) for every job whose config does not compose or fails ``config.validate``
    (``sweeps.check_jobs``, what a multirun checks before its first job); [] when all are valid."""
    from hydra import initialize_config_dir

    from ..run.runfolder import register_resolvers
    from ..run.sweeps import check_jobs

    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        bad = check_jobs("train", [job.overrides for job in jobs])
    return [(jobs[number], message) for number, _, message in bad]


def main(argv: list[str] | None = None) -> int:
    """The command line: Hydra overrides, then ``--out DIR`` (required), ``--wrap "CMD"`` (a prefix for every
    job, e.g. ``cpulock shared``), ``--dry-run`` (print the commands), ``--max-jobs N``. Returns the exit code:
    0, 2 for a usage error, or the first failed job's code (the sweep stops there)."""
    import argparse

    p = argparse.ArgumentParser(prog="study.py", description="Run a sweep one job per command.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=staleness_sweep seed=0,1,2")
    p.add_argument("--out", required=True, help="the study folder: one run folder per job under it")
    p.add_argument("--wrap", default="", help='a command prefix for every job, e.g. "cpulock shared"')
    p.add_argument("--dry-run", action="store_true", help="print the jobs' commands and exit")
    p.add_argument("--max-jobs", type=int, default=0, help="stop after starting this many jobs (0 = all)")
    p.add_argument(
        "--drop-weights",
        action="store_true",
        help="after a job finishes, delete its checkpoints/ and policy/ (a SmolLM2-135M job leaves ~1.6 GB; "
        "the scalars, config and finished.json stay: all compare.py reads)",
    )
    args = p.parse_args(argv)
    try:
        jobs = expand(preset_params(args.overrides), args.overrides)
    except Exception as err:  # noqa: BLE001 - Hydra's own message names the bad override
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    bad = invalid_jobs(jobs)
    if bad:  # as a multirun does: every job checked before the first starts (--dry-run too)
        print(
            f"study: error: {len(bad)} of the study's {len(jobs)} jobs have invalid configs; no job was started:",
            file=sys.stderr,
        )
        for job, message in bad[:10]:
            print(f"  {job.name}: {message}", file=sys.stderr)
        if len(bad) > 10:
            print(f"  ... and {len(bad) - 10} more", file=sys.stderr)
        return 2
    out = Path(args.out)
    started = 0
    print(f"study: {len(jobs)} jobs into {out}", flush=True)
    for i, job in enumerate(jobs):
        folder = out / job.name
        if (folder / "finished.json").exists():
            print(f"study: [{i + 1}/{len(jobs)}] {job.name}: finished, skipped", flush=True)
            continue
        train = [*shlex.split(args.wrap), sys.executable, str(ROOT / "recipes" / "train.py")]
        if any((folder / "checkpoints").glob("*.ckpt")):  # started, not finished: continue it where it stopped
            cmd = [*train, "--resume", str(folder)]
        else:  # the folder name holds '=' and ',': Hydra's grammar takes it quoted only
            cmd = [*train, *job.overrides, run_dir_override(folder)]
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        if args.max_jobs and started >= args.max_jobs:
            print(f"study: stopped after {started} jobs (--max-jobs)", flush=True)
            break
        started += 1
        print(f"study: [{i + 1}/{len(jobs)}] {job.name}", flush=True)
        t0 = time.time()
        code = subprocess.call(cmd, cwd=ROOT)
        wall = time.time() - t0
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "study_log.tsv", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\t{job.name}\t{wall:.0f}\t{code}\n")
        print(f"study: {job.name}: exit {code}, {wall:.0f} s", flush=True)
        if code != 0:
            return code
        if args.drop_weights and (folder / "finished.json").exists():
            for weights in ("checkpoints", "policy"):
                shutil.rmtree(folder / weights, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
