"""Byte-level BPE tokenizer for embedded checkpoints, trained offline.

The tokenizer is trained with the `tokenizers` library on the built-in corpus
(`models.embedded.corpus`) to exactly the requested vocabulary size, so the
model's embedding rows and the tokenizer's ids line up one to one and every id
the model can sample decodes to text (or to a special token).

Files written (the layout `transformers.AutoTokenizer` loads):

- `tokenizer.json` — the `tokenizers` serialization (model, pre-tokenizer,
  decoder, post-processor that prepends `<s>`);
- `tokenizer_config.json` — special tokens and a ChatML-style chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.embedded.corpus import training_lines

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
END_TOKEN = "<|end|>"
IMAGE_TOKEN = "<image>"
# Ids are the list positions: <pad>=0, <s>=1, </s>=2, ... (the BPE trainer puts
# special tokens first, in this order).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    END_TOKEN,
    IMAGE_TOKEN,
)
SPECIAL_TOKEN_IDS: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
# Tokens that end a generation: plain end of sequence and end of a chat turn.
STOP_TOKEN_IDS: tuple[int, ...] = (
    SPECIAL_TOKEN_IDS[EOS_TOKEN],
    SPECIAL_TOKEN_IDS[IM_END_TOKEN],
    SPECIAL_TOKEN_IDS[END_TOKEN],
)

# ChatML: `<|im_start|>role\ncontent<|im_end|>\n` per message; the generation
# prompt opens an assistant turn. `<s>` comes from the template because
# `apply_chat_template` encodes without adding special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_MAX_LENGTH = 4096

# Below this size the prose alone has enough distinct merges; above it the
# trainer also sees deterministic compound words (see `training_lines`).
_PROSE_VOCAB_LIMIT = 1024


class TokenizerTrainingError(RuntimeError):
    """The corpus could not supply the requested number of BPE tokens."""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` ids, specials first.

    Raises `TokenizerTrainingError` when the corpus runs out of merges before
    reaching `vocab_size` (it cannot for the sizes the embedded configs use).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    extra = max(0, vocab_size - _PROSE_VOCAB_LIMIT)
    tokenizer.train_from_iterator(training_lines(extra_compounds=extra), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise TokenizerTrainingError(
            f"the built-in corpus yields {tokenizer.get_vocab_size()} BPE tokens, "
            f"{vocab_size} were requested; use a smaller vocab_size"
        )
    bos_id = SPECIAL_TOKEN_IDS[BOS_TOKEN]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """The tokenizer_config.json body: special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, END_TOKEN, IMAGE_TOKEN],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
    }


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    """File name -> text of every tokenizer file for a `vocab_size` checkpoint."""
    tokenizer = train_tokenizer(vocab_size)
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
    }


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into the folder `out`."""
    for name, text in tokenizer_files(vocab_size).items():
        (out / name).write_text(text, encoding="utf-8")
