"""The gradient-bias probe: each correction's batch gradient under a mismatched sampler, against on-policy.

    python recipes/probe_gradients.py                                         # SmolLM2-135M, sigma = 0.5, 1, 2
    python recipes/probe_gradients.py model=tiny probe.batches=4 probe.reference_batches=4
    python recipes/probe_gradients.py model.name_or_path=outputs/<run>/policy 'probe.corrections=[none,sc]'

Prints and writes (to the run folder) probe.md (the table), probe.png (bias, drift and MSE against the
realised KL) and probe.json (every number). The logic is in lit_rl.tools.probe; this file is only the front door.
"""

import sys

# OpenMP reads its settings once, when torch loads it: lit_rl's defaults first, as recipes/train.py does
from lit_rl.run.hardware import set_omp_defaults  # noqa: E402  (imports no torch)

set_omp_defaults()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lit_rl.config import ConfigError  # noqa: E402
from lit_rl.run.runfolder import register_resolvers  # noqa: E402
from lit_rl.tools.probe import run_probe  # noqa: E402

register_resolvers()  # conf/train.yaml's hydra section, which the probe's config inherits, uses them


@hydra.main(config_path="../conf", config_name="probe", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run_probe(cfg, cfg.probe.out or HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        print(f"lit_rl: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
