import helpers  # noqa: F401  (the test environment: threads, offline hub; before torch is used)
import pytest

from lit_rl.models import ModelSpec, load_policy


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the random-init tiny Llama, float32."""
    return load_policy(ModelSpec("tiny"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the packaged GGUF (float32)."""
    return load_policy(ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct"))
