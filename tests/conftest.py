"""Shared fixtures. The real SmolLM2 is fetched and converted once into $REFSERVE_HOME
(default ~/.cache/refserve); CI warms that cache by running the main job first."""

import numpy as np
import pytest

# The grader (mechanism markers for every test, `pytest -m scheduler`, `pytest --grade`,
# `--impl DIR`) is tests/grading.py, loaded before collection by `-p grading` in
# pyproject.toml's addopts: a conftest would register its options too late for
# `pytest --impl DIR` (with a space). The test-module -> mechanism map is its RULES.


@pytest.fixture(scope="session")
def smollm2_dir():
    from refserve.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    # The reference continuation ignores EOS: clearing it is the only way to make generate
    # run on without min_new_tokens, which would also *suppress* EOS logits and so change
    # the greedy choice.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def hf_greedy(hf_model, prompt_ids, max_new_tokens):
    """transformers' greedy generate, no EOS stop: the reference continuation."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def hf_greedy_fn():
    return hf_greedy


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (GQA, tied embeddings) saved as an HF folder, no tokenizer."""
    from model_utils import save_tiny_hf_model

    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama", True, 2)
    return folder


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---- the server tests (tests/test_serve*.py; helpers in tests/serve_utils.py) ------------

@pytest.fixture(scope="module")
def tiny_chat_llama(tmp_path_factory):
    """A tiny random Llama with a real tiny tokenizer and a chat template (text prompts)."""
    from tiny_text_model import save_tiny_text_model

    return save_tiny_text_model(tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="module")
def served(tiny_chat_llama):
    """One server per test module: the engine loop and uvicorn on a free 127.0.0.1 port."""
    from serve_utils import ServerThread, make_engine

    s = ServerThread(make_engine(tiny_chat_llama))
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(tiny_chat_llama):
    """The same tiny model behind the offline API, for what the server must equal."""
    from refserve import LLM

    return LLM(model=str(tiny_chat_llama), block_size=4, num_gpu_blocks_override=512,
               progress=False)


@pytest.fixture(scope="module")
def long_tiny_chat_llama(tmp_path_factory):
    """The tiny text model with a 4096-token context: long prompts and long generations
    that take thousands of (cheap) steps."""
    from tiny_text_model import save_tiny_text_model

    return save_tiny_text_model(tmp_path_factory.mktemp("tiny-text-4k"),
                                max_position_embeddings=4096)
