"""Compare finished (or running) lit_rl runs: one plot per TensorBoard tag and a markdown summary table.

    python recipes/compare.py outputs/multirun/2026-11-29/10-00-00 --tags rollout/reward_mean,eval/accuracy

A *run* is a folder that holds TensorBoard event files, directly (what ``recipes/train.py`` writes) or in a
``tensorboard/`` subfolder (what it wrote before). A run's name is its path relative to the folder given on the
command line (for a Hydra multirun: the override_dirname, e.g. ``algo=dapo,seed=1``). Runs whose names differ only by a
``seed=N`` item form one *setting* (``algo=dapo``), wherever the item stands (a job's ``.hydra/overrides.yaml``,
when there is one, says which item is its seed); each tag is shown per setting as the mean over its seeds
with a min–max band across seeds.

Rules (also written under the table in ``summary.md``):

* final — mean over the setting's runs of each run's value of the tag at the last step that every run
  compared logged (each run's last value when they all ended at the same step; otherwise summary.md says
  at which step, and which runs went further).
* best — the maximum over steps of the seed-mean curve, or the minimum for tags that contain ``loss``,
  ``kl``, ``time/`` or ``length`` (case-insensitive), where lower is better. Steps whose mean is not finite
  (a NaN logged by some seed) are skipped.
* The seed-mean at a step is the mean over the runs that logged that step, so the tail of a curve whose
  seeds stopped at different steps averages fewer runs.
* Smoothing is TensorBoard's own: a debiased exponential moving average over the points in order
  (not over step distance), non-finite points passed through, a constant series left as it is.

Against a swept value (``--x rollout.lag``): runs are also split by the numeric value of that override in
their name; each run's value of a tag is the mean of its last ``--final-steps`` logged values (or of the
values at steps ``--window A:B``), averaged over seeds; one PNG per tag (``<tag>_vs_<key>.png``: x = the
value, one line per setting of the other overrides) and ``summary_vs_<key>.md`` (a row per setting, a
column per value). ``--shift-by TAG`` first moves each value from step s to step s - TAG(s): with
``rollout/staleness_mean`` a rollout metric lands on the weight version that generated it, so runs with
different lags compare policies after equally many updates.

Seeds and uncertainty (settings with >= 2 seeds): the plots' band is the 95% t-interval of the seed mean
at each step that every seed of the setting logged (mean ± t_{0.975, n−1}·s/√n, s the sample standard
deviation over the n seeds); ``summary.md`` gets a table of each setting's *final* value — per run the mean
of its values over the last ``--final-steps`` k steps that every compared run logged — as mean ± that
interval. ``--test A B`` (repeatable) compares two settings' finals with Welch's t-interval of the
difference mean_A − mean_B (Welch 1947; Satterthwaite's degrees of freedom) and states "A > B", "A < B"
or "indistinguishable at n_A, n_B seeds" from whether the interval excludes 0. A run that lacks a step
other seeds of its setting logged is flagged (stderr and ``summary.md``), never averaged in silently.

A run without ``finished.json`` (what a training run writes last) is named at the top of ``summary.md``'s notes:
"still being written" while a process holds its folder's ``.lit_rl.lock`` (a live run does), else "stopped
early". Every option (``--test`` settings, ``--final-steps``, ``--window``, ``--shift-by``) is checked before
the first file is written: a mistake exits 2 and writes nothing.

The package, in the order the tool works: ``runs`` finds runs and reads their event files, ``settings`` turns
run names into settings (seeds grouped), ``curves`` builds a setting's seed-mean curve of a tag, ``stats`` the
seed intervals and Welch's test, ``versus`` a tag against a swept value, ``tables`` the markdown of the summaries,
``plots`` the PNGs, and ``cli`` the command line that runs them in turn.
"""

from .cli import main, parse_args
from .curves import Curve, common_step, curves_for, lower_is_better, seed_curve, tb_smooth, value_at
from .runs import CompareError, find_runs, read_scalars, run_state
from .settings import group_runs, recorded_seed, setting_of, split_key
from .stats import (
    Interval,
    WelchResult,
    final_window,
    interval_bands,
    missing_steps,
    run_final,
    seed_finals,
    t_interval,
    t_quantile,
    welch_test,
)
from .tables import format_interval_table, format_table, format_tests, summarize
from .versus import shifted, versus, versus_cells

__all__ = [
    "CompareError",
    "Curve",
    "Interval",
    "WelchResult",
    "common_step",
    "curves_for",
    "final_window",
    "find_runs",
    "format_interval_table",
    "format_table",
    "format_tests",
    "group_runs",
    "interval_bands",
    "lower_is_better",
    "main",
    "missing_steps",
    "parse_args",
    "read_scalars",
    "run_final",
    "run_state",
    "seed_curve",
    "seed_finals",
    "recorded_seed",
    "setting_of",
    "shifted",
    "split_key",
    "summarize",
    "t_interval",
    "t_quantile",
    "tb_smooth",
    "value_at",
    "versus",
    "versus_cells",
    "welch_test",
]
