"""Do later guesses use the hints? For docs/results/multiturn_guess_number_small: from a run's samples.jsonl (every
episode logged), each guess on turns 2-4 of an episode (the turn's last integer, as the environment reads it; a
last turn cut at the token limit was never a guess) is "consistent" when it lies in the range every earlier hint
allows ("N is wrong: higher" -> above N, "lower" -> below N) within [1, high]. Per run: the consistent share of
steps 1-10 and 21-30 and d = late - early with a 95% Wald interval for a difference of proportions.

    python docs/results/multiturn_guess_number_small/hints.py RUN [RUN ...] [--high 4]
"""

import argparse
import json
import re
from pathlib import Path

from lit_rl.tools.compare.stats import wald_difference

HINT = re.compile(r"(-?\d+) is wrong: (higher|lower)")


def later_guesses(episode: dict, high: int) -> list[bool]:
    """Consistency of each guess after the first in one episode (samples.jsonl's ``episode``)."""
    lo, hi, out, turn = 1, high, [], 0
    messages = episode["messages"][1:]  # the opening message first
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            turn += 1
            numbers = re.findall(r"-?\d+", m["content"])
            cut = i == last_assistant and episode.get("finish") == "length"
            if turn >= 2 and numbers and not cut:
                out.append(lo <= int(numbers[-1]) <= hi)
        else:
            hint = HINT.search(m["content"])
            if hint:
                g = int(hint.group(1))
                lo, hi = (max(lo, g + 1), hi) if hint.group(2) == "higher" else (lo, min(hi, g - 1))
    return out


def window(rows: list[dict], first: int, last: int, high: int) -> tuple[int, int]:
    """(consistent later guesses, later guesses) over steps ``first``..``last``."""
    chosen = [r["episode"] for r in rows if first <= r["step"] <= last and "episode" in r]
    flags = [f for episode in chosen for f in later_guesses(episode, high)]
    return sum(flags), len(flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--high", type=int, default=4)
    args = p.parse_args()
    ds = []
    for run in args.runs:
        rows = [json.loads(line) for line in open(Path(run) / "samples.jsonl")]
        (c1, n1), (c2, n2) = window(rows, 1, 10, args.high), window(rows, 21, 30, args.high)
        p1, p2 = c1 / max(n1, 1), c2 / max(n2, 1)
        d, half = wald_difference(p1, n1, p2, n2)
        ds.append(d)
        print(
            f"{run}: consistent later guesses, steps 1-10 {c1}/{n1} = {p1:.3f} -> 21-30 {c2}/{n2} = {p2:.3f}; "
            f"d {d:+.3f} [{d - half:+.3f}, {d + half:+.3f}]"
        )
    print(f"mean d over the runs {sum(ds) / len(ds):+.3f}")


if __name__ == "__main__":
    main()
