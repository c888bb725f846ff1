"""Tools a user runs on finished (or running) runs, beside training: ``compare`` (plots and tables of runs'
TensorBoard scalars, seeds grouped, with intervals and tests)."""
