import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network

from lit_rl.hardware import set_omp_defaults  # noqa: E402  (imports no torch)

set_omp_defaults()  # as recipes/train.py does, before torch loads OpenMP

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

from lit_rl.compare import read_scalars  # noqa: E402,F401  (tests read TensorBoard runs with it)
from lit_rl.models import ModelSpec, load_policy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the random-init tiny Llama, float32."""
    return load_policy(ModelSpec("tiny"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the packaged GGUF (float32)."""
    return load_policy(ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct"))


def chat_prompts(tokenizer, questions):
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out
