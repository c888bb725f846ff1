"""Tools a user runs beside training, each behind a thin front door in recipes/: ``compare`` (plots and tables
of runs' TensorBoard scalars, seeds grouped, with intervals and tests; recipes/compare.py), ``probe`` (each
correction's gradient bias under a mismatched sampler; recipes/probe_gradients.py) and ``study`` (a preset's
sweep run one job per command, seeds first; recipes/study.py)."""
