"""Train a policy with RL from verifiable rewards.

    python recipes/train.py                                   # GRPO, SmolLM2-135M-Instruct, arithmetic
    python recipes/train.py task=gsm8k task.path=<dir with train.jsonl/test.jsonl>
    python recipes/train.py -m model=tiny advantage.alpha=0,1  # a Hydra multirun sweep
    tensorboard --logdir outputs/

The whole loop is in lit_rl.algorithms.base.RLAlgorithm.training_step; this file is only the front door.
"""

import sys

# OpenMP reads its settings once, when torch loads it: set lit_rl's defaults first (an exported value wins).
# OMP_WAIT_POLICY=PASSIVE lets torch's waiting threads sleep: beside another CPU-bound process a step lost
# 1.4-2.0x instead of 2.9-4.8x, for 10% alone (benchmarks/contention.py, benchmarks/README.md)
from lit_rl.hardware import set_omp_defaults  # noqa: E402  (imports no torch)

set_omp_defaults()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lit_rl.algorithms import NonFiniteUpdates  # noqa: E402
from lit_rl.config import ConfigError  # noqa: E402
from lit_rl.train import register_resolvers, run  # noqa: E402

register_resolvers()  # ${lit_rl_run_name:...}: multirun folders named by what the sweep varies


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:  # a user's mistake: say what and where, no traceback
        print(f"lit_rl: error: {err}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteUpdates as err:  # the run diverged: say where, keep the checkpoints, no traceback
        print(f"lit_rl: stopped: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
