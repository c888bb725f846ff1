"""Shared by the benchmark scripts: make sure nothing else competes for the cores while timing, and build the
run's own module (``grpo_module``: the config and ``build_module`` a run of ``recipes/train.py`` uses)."""

from __future__ import annotations

import os
import sys
import time

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _cpu_times() -> dict[int, float]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(pid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def busy_processes(window_s: float = 2.0, threshold: float = 0.2) -> list[tuple[int, float, str]]:
    """Other processes that used more than ``threshold`` of a core over ``window_s`` seconds."""
    me = {os.getpid(), os.getppid()}
    a = _cpu_times()
    time.sleep(window_s)
    b = _cpu_times()
    busy = []
    for pid, t in b.items():
        share = (t - a.get(pid, t)) / window_s
        if pid not in me and share > threshold:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                cmd = "?"
            busy.append((pid, share, cmd))
    return busy


def after_first(series: list[tuple[int, float]]) -> list[float]:
    """A tag's values (``read_scalars``' [(step, value), ...]) in step order without the first logged step's (the
    start-up step: compile, first-use timings, a rollout process starting), or all of them when it has one step.
    By position, not by step number: steps are logged from 1 (as Lightning's ``global_step``), so a filter such as
    ``step > 0`` keeps the first step."""
    values = [v for _, v in sorted(series)]
    return values[1:] if len(values) > 1 else values


def ensure_quiet(force: bool = False) -> None:
    """Print the machine (``machine()``) at the top of the output, then exit with a message if other processes
    are using the CPU (timings would be 7-30x off)."""
    print(f"# {machine()}", flush=True)
    busy = busy_processes()
    if busy and not force:
        print("benchmark: other processes are using the CPU; timings would be meaningless:", file=sys.stderr)
        for pid, share, cmd in busy:
            print(f"  pid {pid}: {share:.0%} of a core: {cmd}", file=sys.stderr)
        print("stop them, or pass --force to time anyway", file=sys.stderr)
        sys.exit(3)


def machine() -> str:
    """The CPU (model, torch's CPU capability, bf16 support), cores, torch, threads and OpenMP wait policy
    (``lit_rl.run.hardware.describe_machine``, which the probe's report uses too)."""
    from lit_rl.run.hardware import describe_machine

    return describe_machine()


def run_config(*overrides: str):
    """The config ``python recipes/train.py <overrides>`` runs with: ``conf/train.yaml`` composed with
    ``overrides``, then checked by ``config.validate``."""
    from hydra import compose, initialize_config_dir

    from lit_rl.config import validate

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    validate(cfg)
    return cfg


def grpo_module(policy, tok, new_tokens: int, group_size: int, *overrides: str):
    """The run's GRPO module around ``policy``, built as a run builds it (``lit_rl.run.train.build_module`` of
    ``run_config``), with the benchmarks' shared settings (micro-batches of 16, lr 1e-6, log-probs in chunks of
    256 tokens) and ``overrides`` (e.g. ``correction=sc``)."""
    from lit_rl.run.train import build_module

    cfg = run_config(
        "algo=grpo",
        f"sampling.max_new_tokens={new_tokens}",
        f"rollout.group_size={group_size}",
        "rollout.micro_batch_size=16",
        "optim.lr=1e-6",
        "logprob_chunk_tokens=256",
        *overrides,
    )
    return build_module(cfg, policy, tok)


def as_rollout_batch(module, r, group_size: int):
    """The training batch of rollouts ``r``: zero rewards, seeded random advantages (same every call)."""
    import torch

    from lit_rl.rollout.types import RolloutBatch, left_pad

    pids, pmask = left_pad(r.prompt_ids, module.tokenizer.pad_token_id)
    n = len(r.prompt_ids)
    return RolloutBatch(
        prompt_ids=pids,
        prompt_mask=pmask,
        response_ids=r.response_ids,
        response_mask=r.response_mask,
        rollout_logprobs=r.rollout_logprobs,
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=torch.Generator().manual_seed(0)),
        group_ids=torch.arange(n) // group_size,
        policy_version=r.policy_version,
        topk_ids=r.topk_ids,
        topk_logprobs=r.topk_logprobs,
    )


def update(module, opt, rb) -> None:
    """One optimizer step of ``module`` on ``rb`` (accumulated micro-batches, then AdamW)."""
    module.accumulate_gradients(rb)
    opt.step()
    opt.zero_grad(set_to_none=True)
