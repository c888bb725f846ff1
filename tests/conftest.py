import helpers  # noqa: F401  (the test environment: threads, offline hub; before torch is used)
import pytest
import torch
from helpers import THREADS

from lit_rl.models import ModelConfig, load_policy


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the random-init tiny Llama, float32."""
    return load_policy(ModelConfig("tiny"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the packaged GGUF (float32)."""
    return load_policy(ModelConfig("HuggingFaceTB/SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session", autouse=True)
def _verifier_workers_stopped_at_the_end():
    """The shared verifier pool stopped and its folder removed when the session ends: a test worker process of
    pytest-xdist leaves without running ``atexit`` handlers, which left a ``lit_rl-verifiers-*`` folder per run."""
    yield
    from lit_rl.tasks.verifier_pool import close_shared_pool

    close_shared_pool()


@pytest.fixture(autouse=True)
def _same_thread_count_for_every_test():
    """Every test starts at the suite's thread count and none leaks another to the tests after it: a run with
    ``threads=1`` or vLLM's in-process CPU worker (which sets torch to 1 thread) used to leave the process at 1
    thread, so the batch-invariant tests passed inside the suite and failed alone at 2 threads."""
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(THREADS)


def pytest_addoption(parser):
    parser.addoption(
        "--reverse",
        action="store_true",
        default=False,
        help="run the collected tests in reverse order (scripts/test.sh runs the batch-invariant "
        "tests so a second time: their results must not depend on what ran before)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
