"""Run folders as recipes/train.py leaves them, written directly (for the compare tests)."""

import json
import os


def write_run(run_dir, scalars, tensor_writer=False, finished=True, old_layout=False):
    """A run folder as recipes/train.py leaves it: config.yaml, events... in the folder itself (``old_layout``: in
    its tensorboard/ subfolder, where runs wrote them before), finished.json (not with ``finished=False``: a run
    still being written, or stopped early)."""
    tb = os.path.join(run_dir, "tensorboard") if old_layout else run_dir
    os.makedirs(tb)
    if tensor_writer:  # tensorboard's own writer: tensor summaries of the scalars plugin
        from tensorboard.summary import Writer

        w = Writer(tb)
        for tag, series in scalars.items():
            for step, value in series.items():
                w.add_scalar(tag, value, step)
        w.close()
    else:  # what Lightning's TensorBoardLogger writes: classic scalar summaries
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(tb)
        for tag, series in scalars.items():
            for step, value in series.items():
                w.add_scalar(tag, value, step)
        w.close()
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write("seed: 0\n")
    if finished:
        with open(os.path.join(run_dir, "finished.json"), "w") as f:
            json.dump({"global_step": 5}, f)
