"""The fixed step and the cross-part config checks never name an algorithm or a rollout mode: what a paper changes
is its ``Algorithm`` (and its config dataclass's rules), what a rollout mode changes is its ``RolloutSource``. A
scan of the step's modules for string constants equal to a registered name (a branch such as
``algo.name == "dapo"`` or ``mode in ("lagged", "async")``) and for identifiers built from an algorithm's name (an
attribute such as ``self.ppo_critic``)."""

import ast
import os
import pathlib

import pytest
import torch
from helpers import ROOT

from lit_rl.algorithms import ALGORITHMS
from lit_rl.rollout.staleness import ROLLOUT_MODES

#: the fixed step (RLModule and the infrastructure it is made of) and the cross-part config checks
STEP_MODULES = [
    "algorithms/module.py",
    "algorithms/optimization.py",
    "algorithms/step_logging.py",
    "algorithms/evaluation.py",
    "algorithms/parallel.py",
    "config.py",
]
#: names that carry "ppo" as the field's standard term, not as a branch on the algorithm: PPO's schedule
#: (``algo.ppo_epochs``) and the objective family several algorithms share (``AlgoConfig.ppo_clip``)
ALLOWED_IDENTIFIERS = {"ppo_epochs", "ppo_clip"}


def names_in(path: str) -> tuple[set[str], set[str]]:
    """(string constants, identifiers) of the Python file at ``path``; docstrings are not constants here."""
    tree = ast.parse(open(path).read())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings, identifiers = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            strings.add(node.value)
        elif isinstance(node, ast.Name):
            identifiers.add(node.id)
        elif isinstance(node, ast.Attribute):
            identifiers.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            identifiers.add(node.name)
        elif isinstance(node, ast.arg):
            identifiers.add(node.arg)
    return strings, identifiers


@pytest.mark.parametrize("module", STEP_MODULES)
def test_the_step_names_no_algorithm_and_no_rollout_mode(module):
    strings, identifiers = names_in(os.path.join(ROOT, "src", "lit_rl", module))
    named = sorted(strings & (set(ALGORITHMS) | set(ROLLOUT_MODES)))
    assert not named, f"{module} branches on {named}: the Algorithm or the RolloutSource owns that"
    built = sorted(
        i for i in identifiers - ALLOWED_IDENTIFIERS if any(i.lower().split("_")[0] == a for a in ALGORITHMS)
    )
    assert not built, f"{module} has identifiers named after an algorithm: {built}"


def test_the_scan_finds_a_branch_on_a_name(tmp_path):
    path = tmp_path / "step.py"
    path.write_text('"""doc mentioning dapo"""\ndef f(cfg):\n    return cfg.algo.name == "dapo" or cfg.ppo_critic\n')
    strings, identifiers = names_in(str(path))
    assert "dapo" in strings and "doc mentioning dapo" not in strings and "ppo_critic" in identifiers


def test_a_ppo_checkpoint_written_before_the_algorithm_was_a_child_module_still_loads(tiny):
    from lit_rl.algorithms.module import RLModule, upgraded_state_dict

    def ppo():
        return RLModule(*tiny, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2, algo={"name": "ppo"})

    module = ppo()
    torch.nn.init.normal_(module.algorithm.value_head.weight)
    now = module.state_dict()
    before = {k.removeprefix("algorithm."): v for k, v in now.items()}  # the keys such a checkpoint holds
    assert "value_head.weight" in before and "algorithm.value_head.weight" not in before
    other = ppo()
    other.load_state_dict(upgraded_state_dict(before))  # strict
    assert torch.equal(other.algorithm.value_head.weight, module.algorithm.value_head.weight)
    assert upgraded_state_dict(now).keys() == now.keys()  # today's checkpoints pass through


def test_the_sample_logger_gets_one_advantage_per_completion():
    from lit_rl.algorithms.base import sequence_advantages

    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    # whitened per-token advantages of rows that average to 0: the first token's value is what each row gets
    per_token = torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    assert sequence_advantages(per_token, mask).tolist() == [0.5, 1.0, 0.0]
    per_sequence = torch.tensor([1.5, -0.5, 0.0])
    assert sequence_advantages(per_sequence, mask) is per_sequence


def test_ppo_samples_record_the_advantages_the_update_used(tmp_path):
    """Issue 33 item 7: samples.jsonl held PPO's pre-update placeholder (0.0 for every completion); it holds the GAE
    advantage of each completion's first token, whitened over the batch's tokens. By hand: the value head starts at
    0, the constant reward 1 comes at the last of 8 tokens (the tiny random model never stops early), so with
    gamma = 1 the advantage of token t is lam^(7 - t); every row is the same, so the first token's whitened value
    is (lam^7 - mean) / std over {lam^0..lam^7} (population std)."""
    import json
    import statistics

    from helpers import fast_config

    from lit_rl.run.train import run

    overrides = ("algo=ppo", "trainer.max_steps=1", "eval.num_examples=0", "log.samples_every_n_steps=1")
    run(fast_config(*overrides, "log.num_samples=8", "task.constant_reward=1"), tmp_path / "r")
    rows = [json.loads(line) for line in open(tmp_path / "r" / "samples.jsonl")]
    per_token = [0.95**k for k in range(8)]
    want = (per_token[-1] - statistics.mean(per_token)) / statistics.pstdev(per_token)
    assert len(rows) == 8
    assert [r["advantage"] for r in rows] == pytest.approx([want] * 8, abs=1e-5)  # -1.4493


#: the build: it reads the typed config (``schema.train_config``, built once) instead of converting sections to dicts
BUILD_MODULES = ["run/train.py", "run/loggers.py", "run/entry.py", *STEP_MODULES[:-1]]


@pytest.mark.parametrize("module", BUILD_MODULES)
def test_the_build_reads_the_typed_config_not_dicts(module):
    """No ``OmegaConf.to_container`` in the build and the step: each part reads its section of ``TrainConfig``
    as attributes (the validation before it, ``config.py``, and the auto settings work on the composed config)."""
    source = open(os.path.join(ROOT, "src", "lit_rl", module)).read()
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("to_container", "to_object")
    ]
    assert not calls, f"{module} line {calls[0].lineno}: convert once with lit_rl.schema.train_config"


#: the modules and functions allowed past the size limits below: the math (objectives, corrections) and the
#: documented kernels whose steps read best in one place (the engine's decode loop is an object of small methods:
#: ``rollout/decode_loop.py``)
LONG_MODULES = {"objectives.py", "corrections.py"}
LONG_FUNCTIONS = {
    ("corrections.py", "centering_term"),
    ("logprobs.py", "response_logprobs"),
    ("batch_invariant.py", "attention"),
}


def test_no_module_over_700_lines_and_no_function_over_80():
    """Files are cut by what they do, not grown into hubs (issue 32): no module in src/ over 700 lines and no
    function over 80, except the math and kernels named above."""
    package = pathlib.Path(ROOT) / "src" / "lit_rl"
    too_long = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > 700 and path.name not in LONG_MODULES:
            too_long.append(f"{path.relative_to(package)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80 and (path.name, node.name) not in LONG_FUNCTIONS:
                    too_long.append(f"{path.relative_to(package)}::{node.name}: {length} lines")
    assert not too_long, too_long
