"""recipes/compare.py and lit_rl.tools.compare on fake runs written with real TensorBoard writers."""

import math
import os
import subprocess
import sys

import pytest
from helpers import write_run

from lit_rl.tools import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "recipes", "compare.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# run name -> {tag: {step: value}}. Hand-computed below: the seed means per step, finals and bests.
RUNS = {
    "algo=grpo,seed=0": {
        "rollout/reward_mean": {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5},
        "train/loss": {0: 1.0, 1: 0.8, 2: 0.6, 3: 0.7, 4: 0.9},
        "eval/accuracy": {2: 0.25, 4: 0.5},
    },
    "algo=grpo,seed=1": {
        "rollout/reward_mean": {0: 0.3, 1: 0.2, 2: 0.5, 3: 0.6, 4: 0.3},
        "train/loss": {0: 1.2, 1: 1.0, 2: 0.8, 3: 0.5, 4: 0.7},
        "eval/accuracy": {2: 0.75, 4: 0.5},
    },
    "algo=dapo,seed=0": {
        "rollout/reward_mean": {0: 0.0, 1: 0.4, 2: 0.6, 3: 0.8, 4: 0.7},
        "train/loss": {0: 2.0, 1: 1.5, 2: 1.25, 3: 1.0, 4: 0.75},
    },
    "algo=dapo,seed=1": {
        "rollout/reward_mean": {0: 0.2, 1: 0.4, 2: 0.4, 3: 0.6, 4: 0.5},
        "train/loss": {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0},
    },
}
# grpo reward mean per step: 0.2 0.2 0.4 0.5 0.4 -> final (0.5+0.3)/2 = 0.4, best (max) 0.5
# dapo reward mean per step: 0.1 0.4 0.5 0.7 0.6 -> final (0.7+0.5)/2 = 0.6, best (max) 0.7
# grpo loss mean per step:   1.1 0.9 0.7 0.6 0.8 -> final 0.8, best (min) 0.6
# dapo loss mean per step:   1.5 1.25 1.125 1.0 0.875 -> final 0.875, best (min) 0.875
# grpo eval/accuracy mean:   step 2: 0.5, step 4: 0.5 -> final 0.5, best 0.5; dapo never logged it
EXPECTED = {
    "algo=grpo": {"rollout/reward_mean": (0.4, 0.5), "train/loss": (0.8, 0.6), "eval/accuracy": (0.5, 0.5)},
    "algo=dapo": {"rollout/reward_mean": (0.6, 0.7), "train/loss": (0.875, 0.875), "eval/accuracy": None},
}
TAGS = ["rollout/reward_mean", "train/loss", "eval/accuracy"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A multirun sweep folder with 2 settings x 2 seeds; algo=dapo,seed=1 written as tensor summaries."""
    root = tmp_path_factory.mktemp("multirun") / "10-00-00"
    for name, scalars in RUNS.items():
        # algo=grpo,seed=1 as runs wrote it before their event files moved into the run folder: still read
        write_run(
            str(root / name), scalars, tensor_writer=(name == "algo=dapo,seed=1"), old_layout=name == "algo=grpo,seed=1"
        )
    return root


def cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def table_rows(text):
    """{setting: [cells]} of the body rows of the first markdown table in ``text``."""
    lines = []
    for ln in text.splitlines():
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:  # the first table ended
            break
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").replace("-", "").replace(":", "")) <= {""}  # the separator row
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(header)
        assert cells[0] not in rows
        rows[cells[0]] = dict(zip(header, cells))
    return header, rows


# ------------------------------------------------------------------------------------------------- finding
def test_find_runs_and_grouping(sweep):
    runs = compare.find_runs([str(sweep)])
    assert sorted(runs) == sorted(RUNS)
    for name, d in runs.items():
        assert os.path.samefile(d, sweep / name)  # the run folder, not its tensorboard/ subfolder
    groups = compare.group_runs(runs)
    assert groups == {
        "algo=dapo": ["algo=dapo,seed=0", "algo=dapo,seed=1"],
        "algo=grpo": ["algo=grpo,seed=0", "algo=grpo,seed=1"],
    }
    assert len(compare.group_runs(runs, group_by_seed=False)) == 4


def test_read_scalars_both_writers(sweep):
    for name in ("algo=grpo,seed=0", "algo=dapo,seed=1"):  # classic scalars; tensor summaries
        got = compare.read_scalars(str(sweep / name))
        assert sorted(got) == sorted(RUNS[name])
        for tag, series in RUNS[name].items():
            assert [s for s, _ in got[tag]] == sorted(series)
            assert [v for _, v in got[tag]] == pytest.approx([series[s] for s in sorted(series)], rel=1e-6)


def test_single_run_folder_named_after_itself(sweep):
    run = sweep / "algo=grpo,seed=0"
    assert compare.find_runs([str(run)]) == {"algo=grpo,seed=0": str(run)}
    old = sweep / "algo=grpo,seed=1"  # events in tensorboard/, the layout before
    assert compare.find_runs([str(old)]) == {"algo=grpo,seed=1": str(old)}
    assert list(compare.find_runs([str(old / "tensorboard")])) == ["algo=grpo,seed=1"]


def test_same_names_in_two_folders_are_prefixed(tmp_path):
    for sweep in ("a", "b"):
        write_run(str(tmp_path / sweep / "seed=0"), {"x": {0: 1.0}})
    runs = compare.find_runs([str(tmp_path / "a"), str(tmp_path / "b")])
    assert sorted(runs) == ["a/seed=0", "b/seed=0"]
    assert compare.group_runs(runs) == {"a": ["a/seed=0"], "b": ["b/seed=0"]}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("algo=dapo,seed=1", ("algo=dapo", 1)),
        ("seed=12,algo=grpo,model=tiny", ("algo=grpo,model=tiny", 12)),
        ("algo=grpo", ("algo=grpo", None)),
        ("seed=0", ("(default)", 0)),
        ("sweepA/algo=grpo,+seed=3", ("sweepA/algo=grpo", 3)),
        ("sweepA/seed=3", ("sweepA", 3)),
        ("data.seed=3,algo=grpo", ("data.seed=3,algo=grpo", None)),  # only the top-level seed key
        ("10-00-00", ("10-00-00", None)),
    ],
)
def test_setting_of(name, expected):
    assert compare.setting_of(name) == expected


# ----------------------------------------------------------------------------------------------- smoothing
def test_tb_smooth_matches_hand_computed_debiased_ema():
    # w = 0.5: last = 0.5, 1.25, 2.625; debias = 0.5, 0.75, 0.875 -> 1, 5/3, 3
    assert compare.tb_smooth([1.0, 2.0, 4.0], 0.5) == pytest.approx([1.0, 5 / 3, 3.0])
    # w = 0.6: last = 0.4*2 = 0.8, 0.48 + 0 = 0.48; debias 0.4, 0.64 -> 2, 0.75
    assert compare.tb_smooth([2.0, 0.0], 0.6) == pytest.approx([2.0, 0.75])
    assert compare.tb_smooth([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]  # weight 0: no smoothing
    assert compare.tb_smooth([0.7, 0.7, 0.7], 0.9) == [0.7, 0.7, 0.7]  # constant: left as it is
    out = compare.tb_smooth([1.0, math.nan, 3.0], 0.5)  # NaN passes through, does not count
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(1.75 / 0.75)
    assert compare.tb_smooth([], 0.6) == []


# ---------------------------------------------------------------------------------------------- summarizing
def test_summarize_values(sweep):
    runs = compare.find_runs([str(sweep)])
    scalars = {n: compare.read_scalars(d) for n, d in runs.items()}
    rows = compare.summarize(compare.group_runs(runs), scalars, TAGS)
    assert [r["setting"] for r in rows] == ["algo=dapo", "algo=grpo"]
    for row in rows:
        assert row["seeds"] == 2
        for tag in TAGS:
            want = EXPECTED[row["setting"]][tag]
            if want is None:
                assert row[tag] is None
            else:
                assert (row[tag]["final"], row[tag]["best"]) == pytest.approx(want, rel=1e-6), (row["setting"], tag)


def test_seed_curve_band():
    c = compare.seed_curve([[(0, 1.0), (1, 3.0)], [(0, 3.0), (1, 5.0), (2, 7.0)]])
    assert c.steps == [0, 1, 2]
    assert c.mean == [2.0, 4.0, 7.0] and c.lo == [1.0, 3.0, 7.0] and c.hi == [3.0, 5.0, 7.0]
    assert c.count == [2, 2, 1] and c.finals == [3.0, 7.0]


def test_lower_is_better_rule():
    for tag in ("train/loss", "train/value_loss", "train/ref_kl", "time/step_s", "rollout/response_length_mean"):
        assert compare.lower_is_better(tag)
    for tag in ("rollout/reward_mean", "eval/accuracy", "train/entropy"):
        assert not compare.lower_is_better(tag)


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_writes_pngs_and_summary(sweep, tmp_path):
    out = tmp_path / "cmp"
    res = cli(sweep, "--tags", ",".join(TAGS), "--out", out)
    assert res.returncode == 0, res.stderr
    header, rows = table_rows(res.stdout)
    assert header == [
        "setting",
        "seeds",
        "rollout/reward_mean final",
        "rollout/reward_mean best (max)",
        "train/loss final",
        "train/loss best (min)",
        "eval/accuracy final",
        "eval/accuracy best (max)",
    ]
    assert rows == {
        "algo=dapo": dict(zip(header, ["algo=dapo", "2", "0.6", "0.7", "0.875", "0.875", "n/a", "n/a"])),
        "algo=grpo": dict(zip(header, ["algo=grpo", "2", "0.4", "0.5", "0.8", "0.6", "0.5", "0.5"])),
    }
    summary = (out / "summary.md").read_text()
    assert table_rows(summary) == (header, rows)
    for tag in TAGS:
        png = out / (tag.replace("/", "_") + ".png")
        data = png.read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_MAGIC
        import matplotlib.image

        assert matplotlib.image.imread(str(png)).ndim == 3  # decodes as an image


def test_cli_default_out_and_no_grouping(sweep):
    res = cli(sweep, "--tags", "rollout/reward_mean", "--no-group-by-seed", "--smoothing", "0.9")
    assert res.returncode == 0, res.stderr
    _, rows = table_rows(res.stdout)
    assert sorted(rows) == sorted(RUNS)
    assert rows["algo=dapo,seed=1"]["rollout/reward_mean final"] == "0.5"
    assert rows["algo=dapo,seed=1"]["rollout/reward_mean best (max)"] == "0.6"
    assert (sweep / "compare" / "rollout_reward_mean.png").read_bytes()[:8] == PNG_MAGIC
    assert (sweep / "compare" / "summary.md").exists()


def test_cli_empty_folder(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    res = cli(tmp_path / "empty", "--tags", "rollout/reward_mean")
    assert res.returncode == 2
    assert f"no TensorBoard event files under {tmp_path / 'empty'}" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_missing_folder(tmp_path):
    res = cli(tmp_path / "nope", "--tags", "rollout/reward_mean")
    assert res.returncode == 2
    assert f"no such folder: {tmp_path / 'nope'}" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_unknown_tag(sweep, tmp_path):
    res = cli(sweep, "--tags", "eval/acc,train/lss", "--out", tmp_path / "o")
    assert res.returncode == 2
    assert "'eval/acc', 'train/lss' not logged by any run" in res.stderr
    for tag in TAGS:  # the tags that exist are listed
        assert tag in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()  # nothing written


def test_cli_compares_the_tags_that_exist_and_warns_about_the_rest(tmp_path):
    """The README's own example on runs too short to have evaluated: eval/accuracy is missing everywhere."""
    root = tmp_path / "sweep"
    for name, scalars in RUNS.items():
        write_run(str(root / name), {t: v for t, v in scalars.items() if t != "eval/accuracy"})
    res = cli(root, "--tags", "rollout/reward_mean,eval/accuracy", "--out", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    assert "compare: warning: tag 'eval/accuracy' not logged by any run, left out" in res.stderr
    header, rows = table_rows(res.stdout)
    assert header == ["setting", "seeds", "rollout/reward_mean final", "rollout/reward_mean best (max)"]
    assert rows["algo=grpo"]["rollout/reward_mean final"] == "0.4"
    assert (tmp_path / "o" / "rollout_reward_mean.png").exists()
    assert not (tmp_path / "o" / "eval_accuracy.png").exists()
    assert "not logged by any run, left out:** eval/accuracy" in (tmp_path / "o" / "summary.md").read_text()


def test_runs_that_stopped_at_different_steps_are_compared_at_a_common_step(tmp_path):
    """dapo,seed=1 stopped after step 2: final compares every run at step 2 (not dapo's step 2 with grpo's
    step 4), and summary.md says so; the seed-mean curves and best still use every step."""
    root = tmp_path / "sweep"
    for name, scalars in RUNS.items():
        if name == "algo=dapo,seed=1":
            scalars = {t: {k: v for k, v in series.items() if k <= 2} for t, series in scalars.items()}
        write_run(str(root / name), scalars)
    res = cli(root, "--tags", "rollout/reward_mean,eval/accuracy", "--out", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    _, rows = table_rows(res.stdout)
    # at step 2: grpo (0.3 + 0.5) / 2 = 0.4, dapo (0.6 + 0.4) / 2 = 0.5 (last values would give 0.4 and 0.55)
    assert rows["algo=grpo"]["rollout/reward_mean final"] == "0.4"
    assert rows["algo=dapo"]["rollout/reward_mean final"] == "0.5"
    # eval/accuracy: only the grpo runs logged it, both up to step 4: their last values
    assert rows["algo=grpo"]["eval/accuracy final"] == "0.5"
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert (
        "**rollout/reward_mean: the runs stopped at different steps**; final is each run's value at step 2, "
        "the last step all of them logged; later steps of algo=dapo,seed=0 (step 4), algo=grpo,seed=0 (step 4), "
        "algo=grpo,seed=1 (step 4) are left out of final."
    ) in summary
    assert "eval/accuracy: the runs stopped" not in summary
    assert "rollout/reward_mean: the runs stopped at different steps" in res.stderr


def test_cli_bad_smoothing(sweep):
    res = cli(sweep, "--tags", "train/loss", "--smoothing", "1")
    assert res.returncode == 2 and "--smoothing must be in [0, 1)" in res.stderr


# ---------------------------------------------------------------------------------- seeds and uncertainty
T975 = {2: 4.302652729749462, 4: 2.7764451051977987}  # Student's t quantiles (tables)


def test_t_interval_hand_values():
    iv = compare.t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, half = t_{0.975,2} / sqrt(3)
    assert (iv.mean, iv.sd, iv.n) == (2.0, 1.0, 3)
    assert iv.half == pytest.approx(T975[2] / math.sqrt(3), rel=1e-9) == pytest.approx(2.484138, abs=1e-6)
    assert compare.t_quantile(2) == pytest.approx(T975[2], rel=1e-9)
    one = compare.t_interval([5.0])
    assert one.mean == 5.0 and math.isnan(one.half)


def test_welch_hand_values():
    # A = (0.9, 1.0, 1.1), B = (0.1, 0.2, 0.3): diff 0.8, s^2 = 0.01 each, se^2 = 0.02/3, df = 4
    r = compare.welch_test([0.9, 1.0, 1.1], [0.1, 0.2, 0.3])
    assert r.diff == pytest.approx(0.8) and r.df == pytest.approx(4.0)
    assert r.half == pytest.approx(T975[4] * math.sqrt(0.02 / 3), rel=1e-9) == pytest.approx(0.226696, abs=1e-6)
    assert r.verdict == "A > B"
    assert compare.welch_test([0.1, 0.2, 0.3], [0.9, 1.0, 1.1]).verdict == "A < B"
    # A = (1, 2, 3), B = (4, 5, 9): s_A^2 = 1, s_B^2 = 7, se^2 = 8/3, df = (8/3)^2 / ((1/3)^2/2 + (7/3)^2/2) = 2.56
    r = compare.welch_test([1.0, 2.0, 3.0], [4.0, 5.0, 9.0])
    assert r.diff == -4.0 and r.df == pytest.approx(2.56)
    from scipy.stats import t

    assert r.half == pytest.approx(t.ppf(0.975, 2.56) * math.sqrt(8 / 3), rel=1e-9)
    assert r.lo < 0 < r.hi and r.verdict == "indistinguishable at 3, 3 seeds"
    with pytest.raises(ValueError, match=">= 2 seeds"):
        compare.welch_test([1.0], [2.0, 3.0])


# three settings x 3 seeds of train/ref_kl, steps 0-3; finals over the last 2 steps (2, 3):
# none (0.9, 1.0, 1.1), sc (0.1, 0.2, 0.3), tis (0.5, 0.5, 0.5); tis seed 2 lacks step 1 (flagged)
SEEDED = {
    "correction=none,seed=0": {0: 0.0, 1: 0.5, 2: 0.8, 3: 1.0},
    "correction=none,seed=1": {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.0},
    "correction=none,seed=2": {0: 0.0, 1: 0.5, 2: 1.2, 3: 1.0},
    "correction=sc,seed=0": {0: 0.0, 1: 0.1, 2: 0.1, 3: 0.1},
    "correction=sc,seed=1": {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.2},
    "correction=sc,seed=2": {0: 0.0, 1: 0.1, 2: 0.4, 3: 0.2},
    "correction=tis,seed=0": {0: 0.0, 1: 0.2, 2: 0.5, 3: 0.5},
    "correction=tis,seed=1": {0: 0.0, 1: 0.3, 2: 0.4, 3: 0.6},
    "correction=tis,seed=2": {0: 0.0, 2: 0.6, 3: 0.4},
}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded") / "sweep"
    for name, series in SEEDED.items():
        write_run(str(root / name), {"train/ref_kl": series})
    return root


def test_interval_bands_and_flags(seeded):
    runs = compare.find_runs([str(seeded)])
    scalars = {n: compare.read_scalars(d) for n, d in runs.items()}
    groups = compare.group_runs(runs)
    assert compare.missing_steps(groups, scalars, "train/ref_kl") == {"correction=tis,seed=2": [1]}
    bands = compare.interval_bands(groups, scalars, "train/ref_kl")
    steps, lo, hi = bands["correction=tis"]
    assert steps == [0, 2, 3]  # no band at step 1, which one seed lacks
    half = T975[2] * 0.1 / math.sqrt(3)  # step 2: 0.5, 0.4, 0.6 -> s = 0.1
    assert (lo[1], hi[1]) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-6)
    assert compare.final_window(scalars, "train/ref_kl", 2) == [2, 3]
    finals = compare.seed_finals(groups, scalars, "train/ref_kl", 2)
    assert finals["correction=none"] == pytest.approx([0.9, 1.0, 1.1], abs=1e-6)
    assert finals["correction=sc"] == pytest.approx([0.1, 0.2, 0.3], abs=1e-6)


def test_cli_intervals_and_welch_test(seeded, tmp_path):
    out = tmp_path / "cmp"
    res = cli(
        seeded,
        "--tags",
        "train/ref_kl",
        "--final-steps",
        "2",
        "--out",
        out,
        "--test",
        "correction=none",
        "correction=sc",
        "--test",
        "correction=tis",
        "correction=none",
    )
    assert res.returncode == 0, res.stderr
    assert "correction=tis,seed=2 lacks 1 step(s) of train/ref_kl" in res.stderr
    summary = (out / "summary.md").read_text()
    assert "shaded = 95% t-interval" in summary
    section = summary[summary.index("## Seeds") :]
    header, rows = table_rows(section)
    assert header == ["setting", "seeds", "train/ref_kl final", "± 95%"]
    half = T975[2] * 0.1 / math.sqrt(3)  # s = 0.1 for none and sc; 0 for tis
    assert rows["correction=none"]["train/ref_kl final"] == "1" and rows["correction=none"]["± 95%"] == f"{half:.4g}"
    assert rows["correction=sc"]["train/ref_kl final"] == "0.2" and rows["correction=sc"]["± 95%"] == f"{half:.4g}"
    assert float(rows["correction=tis"]["± 95%"]) < 1e-6  # three equal finals (up to float32 rounding)
    assert "**flagged**: correction=tis,seed=2 lacks 1 step(s)" in section
    test1 = section[section.index("## --test correction=none vs correction=sc") :]
    _, t_rows = table_rows(test1)
    row = t_rows["train/ref_kl"]
    assert row["A − B"] == "0.8" and row["df"] == "4" and row["result"] == "A > B"
    assert row["Welch interval"] == "[0.5733, 1.027]"
    test2 = section[section.index("## --test correction=tis vs correction=none") :]
    _, t_rows = table_rows(test2)
    assert t_rows["train/ref_kl"]["result"] == "A < B"
    assert "Flagged (missing steps): correction=tis,seed=2" in test2
    assert (out / "train_ref_kl.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_test_tag_one_setting_lacks(tmp_path):
    # a tag only one setting logs (tis_clipfrac: runs without TIS have none) is reported, not a failed comparison
    root = tmp_path / "sweep"
    for seed in range(2):
        write_run(str(root / f"correction=tis,seed={seed}"), {"r": {0: 0.1 * seed, 1: 0.5}, "clip": {0: 0.1, 1: 0.2}})
        write_run(str(root / f"correction=none,seed={seed}"), {"r": {0: 0.0, 1: 0.5 + seed}})
    res = cli(root, "--tags", "r,clip", "--out", tmp_path / "o", "--test", "correction=tis", "correction=none")
    assert res.returncode == 0, res.stderr
    _, rows = table_rows((tmp_path / "o" / "summary.md").read_text().split("## --test", 1)[1])
    assert rows["clip"]["result"] == "not tested: needs >= 2 seeds of the tag in each setting"
    assert rows["clip"]["A mean ±"] == "2 seed(s)" and rows["clip"]["B mean ±"] == "0 seed(s)"
    assert rows["r"]["A − B"] == "-0.5" and rows["r"]["result"] == "indistinguishable at 2, 2 seeds"


def test_cli_test_unknown_setting(seeded, tmp_path):
    res = cli(seeded, "--tags", "train/ref_kl", "--out", tmp_path / "o", "--test", "correction=sc", "correction=mis")
    assert res.returncode == 2 and "--test: no setting 'correction=mis'" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()  # checked before the first PNG: nothing written


def test_summary_says_which_runs_are_not_finished(tmp_path):
    """finished.json is what a run writes last; a run without it is still being written while a process holds its
    folder's lock (as a live training run does), else it stopped early."""
    import fcntl

    root = tmp_path / "sweep"
    for name in ("done", "live", "stopped"):
        write_run(str(root / name), {"r": {0: 0.1, 1: 0.2}}, finished=name == "done")
        (root / name / ".lit_rl.lock").write_text("{}")
    fd = os.open(root / "live" / ".lit_rl.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the claim a live run holds (lit_rl.run.runfolder)
        res = cli(root, "--tags", "r", "--out", tmp_path / "o")
    finally:
        os.close(fd)
    assert res.returncode == 0, res.stderr
    summary = (tmp_path / "o" / "summary.md").read_text()
    lines = [ln for ln in summary.splitlines() if ln.startswith("- **not finished**")]
    assert len(lines) == 2
    assert lines[0].endswith("live: still being written (a live process holds it)")
    assert lines[1].endswith(f"stopped: stopped early (continue it with --resume {root / 'stopped'})")
    assert "done:" not in summary.split("Runs per setting")[0]
    assert (
        compare.run_state(str(root / "live")) == "stopped early (continue it with --resume " + str(root / "live") + ")"
    )


def test_versus_with_seeds_gets_intervals(tmp_path):
    """``--x``: a point with >= 2 seeds gets its t-interval (error bar, and a second table in summary_vs)."""
    runs = {
        "correction=tis,rollout.lag=0,seed=0": 0.5,
        "correction=tis,rollout.lag=0,seed=1": 0.7,
        "correction=tis,rollout.lag=4,seed=0": 0.3,
    }
    for name, v in runs.items():
        write_run(str(tmp_path / "sweep" / name), {"rollout/reward_mean": {0: 0.0, 1: v}})
    out = tmp_path / "cmp"
    assert (
        compare.main(
            [str(tmp_path / "sweep"), "--tags", "rollout/reward_mean", "--x", "rollout.lag", "--out", str(out)]
        )
        == 0
    )
    table = (out / "summary_vs_rollout.lag.md").read_text()
    half = 12.706204736174707 * math.sqrt(0.02) / math.sqrt(2)  # t_{0.975,1} * s / sqrt(2), s^2 = 0.02
    assert f"| correction=tis | 0.6 ± {half:.4g} [2] | 0.3 ± n/a [1] |" in table
    assert (out / "rollout_reward_mean_vs_rollout.lag.png").read_bytes()[:8] == PNG_MAGIC


# ----------------------------------------------------- seeds of a swept value with "/" (issue 33, item 5)
@pytest.mark.parametrize("seed_first", [True, False])
def test_seeds_group_whatever_the_order_of_a_swept_path_and_seed(tmp_path, seed_first):
    """Folders as an older lit_rl left them: a swept value with "/" made them two levels deep, and with
    ``seed`` first on the command line compare saw 4 settings of 1 seed instead of 2 x 2."""
    for path in ("data/a.jsonl", "data/b.jsonl"):
        for seed in (0, 1):
            items = [f"seed={seed}", f"task.path={path}"] if seed_first else [f"task.path={path}", f"seed={seed}"]
            run = tmp_path / ",".join(items)
            write_run(str(run), {"rollout/reward_mean": {1: 0.1 * seed}})
            (run / ".hydra").mkdir()
            (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in ["task=dataset", *items]))
    groups = compare.group_runs(compare.find_runs([str(tmp_path)]))
    assert sorted(groups) == ["task.path=data/a.jsonl", "task.path=data/b.jsonl"]
    assert all(len(runs) == 2 for runs in groups.values())


def test_the_recorded_seed_picks_the_seed_item_of_a_name(tmp_path):
    # a path value that holds "seed=1" is no seed item when the run's record says seed=0
    assert compare.setting_of("seed=0,task.path=runs/seed=1", 0) == ("task.path=runs/seed=1", 0)
    assert compare.setting_of("seed=0,task.path=data/a.jsonl") == ("task.path=data/a.jsonl", 0)
    run = tmp_path / "r"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- algo=dapo\n- +seed=7\n")
    assert compare.recorded_seed(run) == 7 and compare.recorded_seed(tmp_path / "none") is None


def test_eval_tags_are_scores_and_patterns_expand_to_the_logged_tags():
    """Every eval/ tag is higher-is-better whatever its set's name holds; ``eval/*/pass@*`` stands for each eval
    set's pass@k that a run logged (issue 40)."""
    for tag in ("eval/kl_heldout/accuracy", "eval/long_length/worst@8", "eval/maj@8"):
        assert not compare.lower_is_better(tag)
    from lit_rl.tools.compare.cli import logged_tags

    known = ["eval/accuracy", "eval/gsm/pass@1", "eval/gsm/pass@2", "eval/math/pass@1", "train/loss"]
    assert logged_tags(["eval/*/pass@*", "train/loss"], known) == (
        ["eval/gsm/pass@1", "eval/gsm/pass@2", "eval/math/pass@1", "train/loss"],
        [],
    )
    assert logged_tags(["eval/*/maj@*", "train/loss"], known) == (["train/loss"], ["eval/*/maj@*"])


def test_wald_difference_of_two_proportions_by_hand():
    """0.1 of 100 -> 0.3 of 100: d 0.2, half-width 1.96 * sqrt(0.09/100 + 0.21/100) = 1.96 * sqrt(0.003)."""
    from lit_rl.tools.compare.stats import wald_difference

    d, half = wald_difference(0.1, 100, 0.3, 100)
    assert d == pytest.approx(0.2) and half == pytest.approx(1.96 * math.sqrt(0.003), rel=1e-12)
    assert wald_difference(0.0, 0, 1.0, 10) == (1.0, 0.0)  # an empty sample counts as one trial; p in {0, 1}: 0
