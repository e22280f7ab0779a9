"""Tiny chat-model text encoders and tokenizers built in memory from configs, for the offline pipelines of the families
whose text encoder is a decoder LLM read through a chat template: FLUX.2 [dev] (Mistral-3), FLUX.2 [klein] and
Z-Image (Qwen3). Below the families (docs/architecture.md): it imports no family.

The tokenizer is a byte-level BPE in Qwen2's style (``Qwen2Tokenizer``): the 256 byte characters, and each listed word
after a space is one token (built by merges from its left end), so a shapes-world prompt is a few tokens and no text
is ever out of vocabulary. The chat templates are the real ones as far as a one-turn text prompt reads them.
"""

import re

from ddpo_group.diffusion.tiny import TOKENIZER_WORDS, bytes_to_unicode

# positions of the tiny text encoders: the pipelines' 512 text tokens and room for a template
MAX_POSITIONS = 576

# Qwen3's chat template, as far as a one-turn prompt reads it (thinking on: nothing after the assistant header;
# enable_thinking=False: an empty think block, as Qwen3's own template writes it)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# Mistral's chat with a system prompt, for the content lists Flux2Pipeline's format_input writes
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% for part in message['content'] %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ part['text'] }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ part['text'] }}[/INST]{% endif %}{% endfor %}{% endfor %}"
)


def tiny_bpe_vocab(words):
    """(vocab token -> id, merges) of the byte-level BPE: id 0 "<|endoftext|>", the 256 byte characters, then every
    prefix of each " word" ("Ġr", "Ġre", "Ġred"), with the merges that build it from the left."""
    byte_to_char = bytes_to_unicode()
    vocab = {"<|endoftext|>": 0}
    for char in byte_to_char.values():
        vocab[char] = len(vocab)
    merges, seen = [], set()
    for word in sorted(set(words)):
        chars = [byte_to_char[b] for b in (" " + word).encode("utf-8")]
        piece = chars[0]
        for char in chars[1:]:
            if (piece, char) not in seen:
                seen.add((piece, char))
                merges.append((piece, char))
            piece += char
            vocab.setdefault(piece, len(vocab))
    return vocab, merges


def build_tiny_chat_tokenizer(template, special_tokens, extra_words=()):
    """A Qwen2Tokenizer of ``tiny_bpe_vocab`` (the shapes-world words and `extra_words`) with `special_tokens` and
    `template` as its chat template; pads on the right with "<|endoftext|>"."""
    from transformers import Qwen2Tokenizer

    vocab, merges = tiny_bpe_vocab(tuple(TOKENIZER_WORDS) + tuple(extra_words))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = template
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = MAX_POSITIONS
    return tokenizer


def build_tiny_qwen3_tokenizer():
    """The tiny tokenizer with Qwen3's chat markers, think tokens and chat template (FLUX.2 [klein], Z-Image)."""
    return build_tiny_chat_tokenizer(QWEN3_CHAT_TEMPLATE, ("<|im_start|>", "<|im_end|>", "<think>", "</think>"))


def build_tiny_mistral_tokenizer(system_message):
    """The tiny tokenizer with Mistral's chat markers and template and the words of `system_message` (FLUX.2 [dev]'s)
    one token each, so that the system message takes tens of tokens, not hundreds, and a prompt fits in a short
    max_sequence_length. Not Pixtral's processor (it needs Mistral's tokenizer files): text prompts only, as the
    pipeline sends them."""
    words = sorted(set(re.findall(r"[A-Za-z]+", system_message)))
    return build_tiny_chat_tokenizer(MISTRAL_CHAT_TEMPLATE, ("<s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]",
                                                             "[/INST]"), words)


def tiny_mistral3_config(vocab_size, hidden_size=16, num_hidden_layers=30, heads=2, head_dim=8, intermediate=32):
    """A Mistral3Config of a `num_hidden_layers`-layer text model (FLUX.2 [dev] reads layers 10, 20 and 30) with a
    1-block Pixtral vision tower (the class needs one; text prompts never run it)."""
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
                         max_position_embeddings=MAX_POSITIONS, pad_token_id=0),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, patch_size=14, image_size=56),
        image_token_index=vocab_size,  # outside the vocab: no text prompt holds it
    )


def tiny_qwen3_config(vocab_size, hidden_size=16, num_hidden_layers=27, heads=2, head_dim=8, intermediate=32):
    """A Qwen3Config of a `num_hidden_layers`-layer model (FLUX.2 [klein] reads layers 9, 18 and 27; Z-Image the last
    but one)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate,
        num_hidden_layers=num_hidden_layers, num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS, pad_token_id=0,
    )
