"""A training run and its plumbing, apart from the RL math and the loop itself (``algorithms``):

* ``train``: ``run(cfg, out_dir)``: ``prepare_output`` -> ``build`` -> ``fit`` -> ``export``, the Trainer and
  the parts it trains (data, policy, ``RLModule``);
* ``resolve``: what ``auto`` leaves to the run (precision, threads, the engine), filled in at start-up;
* ``model_checks``: what the model allows (context, attention, sliding windows), checked before its weights load;
* ``resume``: continuing a run (its checkpoint, its saved config) and the runs a folder already holds;
* ``loggers``: TensorBoard, CSV, W&B, MLflow; ``callbacks``: adaptive threads, samples, plain lines;
* ``runfolder``: the run folder, claimed atomically at start-up so two runs never share one;
* ``checkpoints``: atomic checkpoint writes and finding the last complete checkpoint;
* ``preemption``: SIGTERM/SIGUSR1 (SLURM)/SIGINT (Ctrl-C) checkpoint the last finished step, exit and requeue;
* ``hardware``: what ``auto`` makes of the machine (precision, threads, OpenMP defaults, peak FLOP/s);
* ``flops``: the FLOPs of a step's update and rollouts, for ``perf/mfu``;
* ``sweeps``: the multirun callback that checks every job's config first and lists the jobs that failed.

``hardware``, ``runfolder`` and ``sweeps`` import no torch at module level: ``recipes/train.py`` calls
``set_omp_defaults`` and registers the folder resolvers before torch loads. Keep this file free of imports so
that stays true.
"""
