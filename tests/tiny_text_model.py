"""A tiny random Llama with a real (tiny, byte-level BPE) tokenizer and a chat template,
built in a second from text in this file: text prompts and chat without the real model."""

from __future__ import annotations

TEXT = """\
The engine keeps a pool of blocks. Each block holds the keys and values of sixteen tokens.
A request arrives, waits for a seat, is admitted, advances one token per step and retires.
Continuous batching refills a seat the moment a sequence finishes; static batching waits
for the whole batch. Prefix caching reuses full blocks of a shared prompt. Copy-on-write
lets parallel samples share their prompt until one of them writes. The scheduler spends a
token budget on every step: decodes first, then chunks of waiting prompts.
"""
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tiny_text_model(folder, vocab_size: int = 320, seed: int = 0,
                         max_position_embeddings: int = 256):
    """Write config + safetensors + tokenizer into `folder`; returns the folder. A large
    initializer_range makes the random model's greedy text varied rather than one token."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        initializer_range=0.3, tie_word_embeddings=True,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"))
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder
