"""A model folder's tokenizer is loaded once per process and again when its files change."""

import os

from tiny_text_model import save_tiny_text_model

from refserve.models.loader import load_tokenizer


def test_a_folders_tokenizer_is_shared_until_its_files_change(tmp_path):
    folder = save_tiny_text_model(tmp_path / "model")
    first = load_tokenizer(folder)
    assert first is not None and load_tokenizer(folder) is first
    assert first.decode(first.encode("hello")) == "hello"
    path = folder / "tokenizer.json"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_tokenizer(folder) is not first


def test_a_folder_without_tokenizer_files_has_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


# ------------------------------------------------- `tokenizers` straight, as transformers

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Ünïcödé, emoji 🙂 and\nnew lines"}],
    [{"role": "user", "content": "Count to three"},
     {"role": "assistant", "content": "One, two,"}],                 # to be continued
]
TEXTS = ["The capital of France is", " leading space", "Ünïcödé 🙂 中文 ...\n\n\tcode()",
         "<|im_start|>user\nhi<|im_end|>", "", "a" * 300 + " " + "!?" * 20]


def both_tokenizers(folder):
    from transformers import AutoTokenizer

    from refserve.models.tokenizer import FastTokenizer

    fast = load_tokenizer(folder)
    assert isinstance(fast, FastTokenizer)
    return fast, AutoTokenizer.from_pretrained(folder)


def check_same(fast, hf):
    """Every method the engine calls answers as transformers' own tokenizer does."""
    assert len(fast) == len(hf) and fast.get_vocab() == hf.get_vocab()
    assert fast.eos_token_id == hf.eos_token_id and fast.bos_token_id == hf.bos_token_id
    assert set(fast.added_tokens_decoder) == set(hf.added_tokens_decoder)
    ids = list(range(len(hf)))
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    for text in TEXTS:
        for special in (False, True):
            tokens = fast.encode(text, add_special_tokens=special)
            assert tokens == hf.encode(text, add_special_tokens=special), text
            for skip in (False, True):
                assert fast.decode(tokens, skip_special_tokens=skip) == \
                    hf.decode(tokens, skip_special_tokens=skip)
    for conversation in CONVERSATIONS:
        for generation in (False, True):
            for tokenize in (False, True):
                assert fast.apply_chat_template(
                    conversation, tokenize=tokenize, add_generation_prompt=generation) == \
                    hf.apply_chat_template(conversation, tokenize=tokenize,
                                           add_generation_prompt=generation,
                                           **({"return_dict": False} if tokenize else {}))
        assert fast.apply_chat_template(conversation, tokenize=False,
                                        continue_final_message=True) == \
            hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)


def test_the_tiny_models_tokenizer_answers_as_transformers_does(tmp_path):
    check_same(*both_tokenizers(save_tiny_text_model(tmp_path / "model")))


def test_the_embedded_models_tokenizer_answers_as_transformers_does(smollm2_dir):
    fast, hf = both_tokenizers(smollm2_dir)
    check_same(fast, hf)
    # A negative control: a tokenizer that drops the byte-level prefix space differs.
    assert fast.encode(" leading space", add_special_tokens=False) != \
        hf.encode("leading space", add_special_tokens=False)


def test_other_tokenizer_classes_go_through_transformers(tmp_path):
    """A folder whose config names a class with its own Python-side rules (or cleans up
    spaces) is read by AutoTokenizer, not here."""
    import json

    from refserve.models.tokenizer import fast_tokenizer_config

    folder = save_tiny_text_model(tmp_path / "model")
    assert fast_tokenizer_config(folder) is not None
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for change in ({"tokenizer_class": "LlamaTokenizerFast"},
                   {"clean_up_tokenization_spaces": True}):
        path.write_text(json.dumps({**config, **change}))
        assert fast_tokenizer_config(folder) is None
    assert fast_tokenizer_config(tmp_path) is None          # no tokenizer.json at all
