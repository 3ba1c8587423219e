"""Tokenizer wrapper: round trips, eos ids, chat template parity, streaming text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from models.errors import TokenizerError
from models.tokenizer import load_tokenizer

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "serving large language models with paged attention",
    "naïve café façade — déjà vu",
    "数据 中心 的 模型 服务",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a paged cache?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    return folder


def test_encode_decode_round_trip(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    text = "the lazy café 模型"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_eos_ids_union_generation_config_and_eos_token(checkpoint: Path) -> None:
    assert load_tokenizer(checkpoint).eos_token_ids == (4, 2)


def test_chat_template_matches_transformers(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    for add_prompt in (True, False):
        expected = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_prompt
        )
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add_prompt) == expected
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt.startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(1) == 1 and ids[0] == 1  # bos written once, by the template


def test_chat_template_raise_exception(checkpoint: Path) -> None:
    with pytest.raises(TokenizerError, match="unknown role tool"):
        load_tokenizer(checkpoint).apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_from_jinja_file(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((checkpoint / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(tmp_path).apply_chat_template(MESSAGES) == "Be brief.!"


def test_missing_template_and_missing_tokenizer(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((checkpoint / "tokenizer.json").read_text())
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)


def test_streaming_deltas_reassemble_text(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    prompt = tok.encode("serving")
    completion = " naïve 数据 €ü the fox</s>"  # € and ü are unseen: one token per byte
    generated = tok.encode(completion, add_special_tokens=False)
    stream = tok.detokenizer(prompt)
    deltas = [stream.push(token) for token in generated]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tok.decode(generated)
    # A multi-byte character split over byte tokens is held back, then emitted whole.
    assert "" in deltas[:-1] and any("€" in delta for delta in deltas)


def test_streaming_holds_back_incomplete_utf8(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    text = "café 你好 🙂 naïve"
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE: the emoji spans several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream = tok.detokenizer(tok.encode("Say:", add_special_tokens=False))
    deltas = [stream.push(token) for token in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # something really was held back


def test_streaming_keeps_spaces_and_skips_specials(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    ids = tok.encode(" the  fox\n  jumps", add_special_tokens=False) + [tok.eos_token_ids[0]]
    stream = tok.detokenizer(tok.encode("serving", add_special_tokens=False))
    assert "".join(stream.push(token) for token in ids) == " the  fox\n  jumps"


def test_finish_flushes_a_truncated_character(checkpoint: Path) -> None:
    tok = load_tokenizer(checkpoint)
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    stream = tok.detokenizer()
    streamed = "".join(stream.push(token) for token in ids[:-1])
    assert "\ufffd" not in streamed
    assert streamed + stream.finish() == tok.decode(ids[:-1])
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_byte_level_stream_matches_decode_of_any_ids(checkpoint: Path) -> None:
    """The byte-level streaming path (no window decoding) gives exactly what
    decoding the whole output gives, special tokens and split characters included."""
    tok = load_tokenizer(checkpoint)
    assert tok.streams_bytes
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        stream = tok.detokenizer(tok.encode("serving"))
        streamed = "".join(stream.push(token) for token in ids) + stream.finish()
        assert streamed == tok.decode(ids)
