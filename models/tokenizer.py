"""The checkpoint's tokenizer: encode, decode, stream, chat prompts.

Reads `tokenizer.json` with the `tokenizers` library (no transformers import on
the serving path) and `tokenizer_config.json` for the special tokens and the
Jinja chat template (also accepted from `chat_template.jinja` or
`chat_template.json`, where newer checkpoints keep it). End-of-sequence ids are
the union of `generation_config.json`, `config.json` and the tokenizer's
`eos_token`, so every way a checkpoint declares a stop token is honoured.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from models.errors import TokenizerError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Prompt tokens kept as decoding context so the first streamed token gets the
# same leading space/merge it would have in the full text.
_DETOKENIZE_CONTEXT = 5
_INCOMPLETE_CHAR = "\ufffd"
# SentencePiece-style byte-fallback pieces, e.g. "<0xE2>".
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_alphabet()


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the checkpoint's metadata."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>", ...}
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._is_byte_level: bool | None = None  # read from the backend on first use
        self._plain_byte_level = False  # the decoder is ByteLevel and nothing else
        self._added_ids: set[int] = set()
        # Each token's bytes as streamed text shows them (special tokens skipped).
        self._stream_bytes: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it tokenizes (`encode` holds it
        # throughout), so other threads run meanwhile; same ids.
        batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which need not be whole UTF-8
        characters (a byte-level BPE token may hold half of one)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        byte_level = self._byte_level and token_id not in self._added_ids
        if byte_level and all(char in _BYTE_LEVEL_CHARS for char in piece):
            return bytes(_BYTE_LEVEL_CHARS[char] for char in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def _byte_level(self) -> bool:
        if self._is_byte_level is None:
            decoder = json.loads(self.backend.to_str()).get("decoder") or {}
            kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
            self._is_byte_level = "ByteLevel" in kinds
            self._plain_byte_level = decoder.get("type") == "ByteLevel"
            self._added_ids = set(self.backend.get_added_tokens_decoder())
        return self._is_byte_level

    def stream_bytes(self, token_id: int) -> bytes:
        """What `token_id` adds to decoded text with special tokens skipped,
        as bytes; only for a plain byte-level decoder (`streams_bytes`)."""
        found = self._stream_bytes.get(token_id)
        if found is None:
            if token_id in self._added_ids:
                found = self.decode([token_id]).encode()
            else:
                found = self.token_bytes(token_id)
            self._stream_bytes[token_id] = found
        return found

    @property
    def streams_bytes(self) -> bool:
        """True when decoding is concatenating the tokens' bytes (a decoder that
        is ByteLevel alone: GPT-2 style BPE), so text can be streamed from
        `stream_bytes` without decoding windows of ids."""
        return self._byte_level and self._plain_byte_level

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render `messages` (`{"role", "content"}` dicts) with the checkpoint's
        template, and `tools` (function definitions) for a template that reads them.

        The result already holds any special tokens the template writes (such
        as `bos_token`); encode it with `add_special_tokens=False`, or use
        `encode_chat`.
        """
        if self.chat_template is None:
            raise TokenizerError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja); use plain completions or add a template"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        extra = {} if tools is None else {"tools": list(tools)}
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **extra,
            **self.special_tokens,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        prompt = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer | ByteStreamDetokenizer:
        """A fresh streaming decoder for one sequence continuing `prompt_ids`."""
        if skip_special_tokens and self.streams_bytes:
            return ByteStreamDetokenizer(self)
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class ByteStreamDetokenizer:
    """`IncrementalDetokenizer` for a plain byte-level tokenizer: each token's
    bytes go through one incremental UTF-8 decoder, which holds back a
    character split over tokens until it completes. No id is decoded twice
    and no context is needed: a byte-level token carries its own spaces."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._bytes = tokenizer.stream_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._bytes(token_id))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas whose concatenation is the full text.

    Decodes a short window of ids twice (with and without the newest token)
    and emits the difference; a delta ending in an incomplete UTF-8 sequence
    (`U+FFFD`) is held back until the following tokens complete it.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE_CHAR):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def finish(self) -> str:
        """At the end of the stream: the held-back text, with U+FFFD for bytes
        that never completed (what a one-shot `decode` of the output shows)."""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = decode(self._ids[self._prefix_offset :], self._skip_special)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        return delta


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in, so
    # templates written for it behave identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not parse: {exc}") from exc


def load_tokenizer(checkpoint_dir: Path | str) -> Tokenizer:
    """Tokenizer of a checkpoint folder; `TokenizerError` when tokenizer.json is absent."""
    folder = Path(checkpoint_dir)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(
            f"{path} not found; the checkpoint needs a fast-tokenizer tokenizer.json"
        )
    backend = BackendTokenizer.from_file(str(path))
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    special = {
        name: token
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (token := _token_text(config.get(name))) is not None
    }
    eos_ids = _eos_ids(folder, backend, special.get("eos_token"))
    return Tokenizer(backend, special, eos_ids, _chat_template(folder, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(entry: Any) -> str | None:
    # Special tokens appear as plain strings or as AddedToken dicts.
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    from_json = _read_json(folder / "chat_template.json").get("chat_template")
    return from_json if isinstance(from_json, str) else None


def _eos_ids(folder: Path, backend: BackendTokenizer, eos_token: str | None) -> tuple[int, ...]:
    ids: list[Any] = []
    for file_name in ("generation_config.json", "config.json"):
        value = _read_json(folder / file_name).get("eos_token_id")
        ids += value if isinstance(value, list) else [value]
    if eos_token is not None:
        ids.append(backend.token_to_id(eos_token))
    valid = (i for i in ids if isinstance(i, int) and not isinstance(i, bool))
    return tuple(dict.fromkeys(valid))
