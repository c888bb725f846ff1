"""The plumbing around a training run, apart from the RL math and the loop itself (``lit_rl.train`` builds
the run and calls Lightning's fit with these pieces):

* ``runfolder``: the run folder, claimed atomically at start-up so two runs never share one;
* ``checkpoints``: atomic checkpoint writes and finding the last complete checkpoint;
* ``preemption``: SIGTERM/SIGUSR1 (SLURM) checkpoint the last finished step, exit and requeue;
* ``hardware``: what ``auto`` makes of the machine (precision, threads, OpenMP defaults, peak FLOP/s);
* ``flops``: the FLOPs of a step's update and rollouts, for ``perf/mfu``;
* ``sweeps``: the multirun callback that checks every job's config first and lists the jobs that failed.

``hardware`` imports no torch at module level: ``recipes/train.py`` calls ``set_omp_defaults`` from it before
torch loads. Keep this file free of imports so that stays true.
"""
