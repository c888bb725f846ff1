"""Train a policy with RL from verifiable rewards.

    python recipes/train.py                                   # GRPO, SmolLM2-135M-Instruct, arithmetic
    python recipes/train.py task=gsm8k task.path=<dir with train.jsonl/test.jsonl>
    python recipes/train.py -m model=tiny advantage.alpha=0,1  # a Hydra multirun sweep (-m may come anywhere)
    python recipes/train.py experiment=alpha_sweep -m         # a sweep preset (refused without -m)
    python recipes/train.py --resume <run folder>             # continue a run (its config.yaml, its last checkpoint)
    tensorboard --logdir outputs/

The whole loop is in lit_rl.algorithms.module.RLModule.training_step; this file is only the front door.
``--resume <folder>`` is ``resume="<folder>"`` written for the shell: a sweep job's folder
(``algo=grpo,advantage.alpha=0``) holds ``=`` and ``,``, which Hydra's override grammar needs quoted.

A mistake in the config exits with 2 before torch or Lightning is imported (they load only to run): a value
``lit_rl.config.validate`` refuses, and what Hydra refuses while composing the config (a value of the wrong
type, an unknown group option or key), which Hydra prints itself, naming the field.
"""

import sys
import traceback

# OpenMP reads its settings once, when torch loads it: set lit_rl's defaults first (an exported value wins).
# GOMP_SPINCOUNT=1000: torch's waiting threads spin briefly, then sleep. Beside another CPU-bound process a step
# lost 1.8-1.9x instead of 2.9-4.8x with libgomp's default, for 3-6% alone (benchmarks/contention.py and its
# README: OMP_WAIT_POLICY=PASSIVE, the default until 2026-12-01, cost 1.3-1.6x on the main job's step alone)
from lit_rl.run.hardware import set_omp_defaults  # noqa: E402  (imports no torch)

set_omp_defaults()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

# none of these imports torch or Lightning: a bad config is refused before they load (lit_rl.run.train imports them)
from lit_rl.config import ConfigError, validate  # noqa: E402
from lit_rl.run.runfolder import discard_refused_run_folder, register_resolvers  # noqa: E402
from lit_rl.run.sweeps import FAILED  # noqa: E402

register_resolvers()  # ${lit_rl_run_name:...}: multirun folders named by what the sweep varies

#: set when Hydra has composed a job's config and called ``main``: Hydra's exit status 1 before that is its
#: refusal of the command line or the config (printed by Hydra, naming the field), which ``__main__`` makes 2
job_started = False


def continues_run(cfg: DictConfig) -> bool:
    """True when the command continues a run (``resume=<folder>`` or ``ckpt_path``): its config is then the run
    folder's config.yaml with the command line's overrides, which ``lit_rl.run.train.run`` reads and validates."""
    return bool(cfg.resume) or cfg.ckpt_path not in (None, "", "null")


def resume_flag(argv: list[str]) -> list[str]:
    """``--resume <folder>`` / ``--resume=<folder>`` -> the override ``resume="<folder>"`` (quoted for Hydra)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--resume" or arg.startswith("--resume="):
            folder = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not folder:
                sys.exit("lit_rl: error: --resume needs a run folder")
            out.append("resume=" + repr(folder).replace("\\\\", "\\"))  # a quoted string in Hydra's grammar
            continue
        out.append(arg)
        i += 1
    return out


def multirun_first(argv: list[str]) -> list[str]:
    """``argv`` with ``-m`` / ``--multirun`` moved to the front: Hydra's parser takes the overrides as one run of
    positional arguments, so ``experiment=algo_zoo -m seed=1`` failed with "unrecognized arguments: seed=1"."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags + [a for a in argv if a not in ("-m", "--multirun")]


def refuse_sweep_without_multirun(hydra_cfg) -> None:
    """ConfigError for a sweep preset (an experiment that sets ``hydra.sweeper.params``) run without ``-m`` while
    some swept key has no value on the command line: Hydra would run one job at the config's defaults, silently.
    A command that gives every swept key a value is one job of the sweep (what ``recipes/study.py`` starts, one
    command per job) and runs."""
    params = hydra_cfg.sweeper.get("params") or {}
    given = {o.split("=", 1)[0].lstrip("+~") for o in hydra_cfg.overrides.task}
    missing = {k: v for k, v in params.items() if k not in given}
    if missing:
        preset = hydra_cfg.runtime.choices.get("experiment") or "this config"
        swept = ", ".join(f"{k}={v}" for k, v in missing.items())
        raise ConfigError(
            f"experiment={preset} is a sweep: add -m (it sweeps {swept}), or give each of those keys one value "
            "to run one job"
        )


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig):
    global job_started
    job_started = True
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    stops: tuple[type[Exception], ...] = ()  # a run's own stops; known once it is imported (with torch)
    try:
        if not multirun:
            refuse_sweep_without_multirun(hydra_cfg)
        if multirun and cfg.resume:
            raise ConfigError("resume=... continues one run; it cannot be swept (-m): continue each job on its own")
        if not continues_run(cfg):
            validate(cfg)  # torch-free: a bad value fails here, in a fraction of a second
        from lit_rl.algorithms import NonFiniteUpdates  # torch and Lightning load from here on
        from lit_rl.algorithms.step_logging import LogprobGapExceeded
        from lit_rl.run.checkpoints import OutputWriteError
        from lit_rl.run.train import run
        from lit_rl.tasks.reward_functions import RewardFunctionFailed

        stops = (NonFiniteUpdates, OutputWriteError, RewardFunctionFailed, LogprobGapExceeded)
        run(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task))
    except (ConfigError, *stops) as err:
        kind, code = ("error", 2) if isinstance(err, ConfigError) else ("stopped", 1)
        print(f"lit_rl: {kind}: {err}", file=sys.stderr)  # a user's mistake or a stopped run: no traceback
        if not multirun:
            if isinstance(err, ConfigError):  # refused before the run wrote anything: no empty folder left
                discard_refused_run_folder(hydra_cfg.runtime.output_dir)
            sys.exit(code)
        return {FAILED: f"{kind}: {err}"}  # the sweep goes on; lit_rl.run.sweeps.SweepReport lists it at the end
    except Exception as err:  # noqa: BLE001 - in a sweep, a crashed job must not end the others
        if not multirun:
            raise
        traceback.print_exc()
        return {FAILED: f"{type(err).__name__}: {err}"}
    return None


if __name__ == "__main__":
    sys.argv[1:] = multirun_first(resume_flag(sys.argv[1:]))
    try:
        main()
    except SystemExit as exit_:
        if exit_.code == 1 and not job_started:  # Hydra refused the command line or the config and said why
            sys.exit(2)
        raise
