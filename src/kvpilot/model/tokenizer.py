"""Tokenizers: loading a checkpoint's own, and the byte-level one built into kvpilot.

The byte-level tokenizer maps every byte to one token whose id is the byte value (0..255),
followed by a few special tokens. It needs no training data, so the built-in ``tiny`` model
and the test checkpoints can ship a real, saveable tokenizer with a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.errors import ModelLoadError

EOS_TOKEN = "<|endoftext|>"
END_OF_TURN_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (EOS_TOKEN, *ROLE_TOKENS, END_OF_TURN_TOKEN)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def special_token_id(token: str) -> int:
    """Id of a special token of the byte-level tokenizer (they follow the 256 byte ids)."""
    return 256 + SPECIAL_TOKENS.index(token)


def _byte_symbols() -> list[str]:
    """The GPT-2 byte-to-unicode table, in byte order (what the ByteLevel pre-tokenizer emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` where token id == byte value, plus special tokens 256.."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_byte_tokenizer(folder: Path) -> None:
    build_byte_tokenizer().save_pretrained(str(folder))


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer via `AutoTokenizer`; `ModelLoadError` when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {folder}: {exc}. A checkpoint folder needs "
            "tokenizer.json (or tokenizer files AutoTokenizer understands) next to config.json"
        ) from exc
