"""GGUF checkpoints: our model from a GGUF file vs transformers reading the same file.

Each case writes a tiny Llama GGUF (tests/gguf_files.py) with its 2-D weights
in one storage type, resolves it to a checkpoint folder through the cache,
and compares prompt and decode logits (fp32) with transformers'
`from_pretrained(..., gguf_file=...)`. Q/K rows are stored in llama.cpp's
permuted layout, so a missed un-permutation fails here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.cli import main
from models.checkpoint_source import checkpoint_folder
from models.embedded.tokenizer import CHAT_TEMPLATE
from models.errors import CheckpointError, GGUFError
from models.gguf import cache
from models.loader import load_model
from models.tokenizer import load_tokenizer
from tests.gguf_files import write_tiny_llama_gguf
from tests.paged_harness import assert_matches_reference, run_paged_generation

Q = gguf.GGMLQuantizationType
DECODE_STEPS = 8


def _reference(gguf_file: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize(
    ("weight_type", "tied"),
    [
        (Q.F32, True),
        (Q.F16, False),
        (Q.BF16, False),
        (Q.Q8_0, False),
        (Q.Q4_0, False),
        (Q.Q4_1, True),
        (Q.Q4_K, False),
        (Q.Q5_K, False),
        (Q.Q6_K, True),
    ],
    ids=lambda value: value.name if isinstance(value, Q) else ("tied" if value else "untied"),
)
def test_logits_match_transformers_reading_the_same_file(
    tmp_path: Path, weight_type: Q, tied: bool
) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", weight_type, tie_word_embeddings=tied)
    folder = checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)
    model, config = load_model(folder, dtype="float32")
    assert config.tie_word_embeddings is tied
    prompts = [[1, 40, 41, 300, 7, 99], [1, 200, 201, 5]]
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=64, decode_steps=DECODE_STEPS
    )
    assert_matches_reference(_reference(gguf_file), prompts, trace, DECODE_STEPS)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.F32)
    folder = checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert 2 in tokenizer.eos_token_ids  # </s>, the file's eos_token_id
    text = "The quick brown fox"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n")


def test_a_folder_holding_one_gguf_file_is_served_from_the_cache(tmp_path: Path) -> None:
    write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.F32)
    cache_dir = tmp_path / "cache"
    folder = checkpoint_folder(tmp_path, cache_dir=cache_dir, progress=False)
    assert folder.name == "tiny"  # the served model is named after the file
    assert folder.parent.parent == cache_dir
    assert (folder / "model.safetensors").is_file()


def test_second_resolution_reuses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.Q8_0)
    first = checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(cache, "_convert", no_conversion)
    assert checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False) == first


def test_a_copy_under_another_name_is_served_under_that_name(tmp_path: Path) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.F32)
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    first = checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)
    second = checkpoint_folder(copy, cache_dir=tmp_path / "cache", progress=False)
    assert (first.name, second.name) == ("tiny", "renamed")
    assert first.parent == second.parent  # one entry per file content
    load_model(second)


def test_an_interrupted_conversion_leaves_no_folder_and_the_next_one_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.F16)
    cache_dir = tmp_path / "cache"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(cache, "write_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            checkpoint_folder(gguf_file, cache_dir=cache_dir, progress=False)
    assert list(cache_dir.iterdir()) == []
    # A process killed outright leaves its staging folder behind: the next
    # conversion removes it.
    entry = f"{cache.file_sha256(gguf_file)}-v{cache.FORMAT_VERSION}"
    abandoned = cache_dir / f"{entry}.tmp-999999999" / "tiny"
    abandoned.mkdir(parents=True)
    folder = checkpoint_folder(gguf_file, cache_dir=cache_dir, progress=False)
    assert sorted(p.name for p in cache_dir.iterdir()) == [entry]
    load_model(folder)


def test_the_cache_directory_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env-cache"))
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", Q.F32)
    folder = checkpoint_folder(gguf_file, progress=False)
    assert folder.is_relative_to(tmp_path / "env-cache")


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    gguf_file = write_tiny_llama_gguf(tmp_path / "q5.gguf", Q.Q5_0)
    with pytest.raises(GGUFError, match=r"tensor 'token_embd.weight' has type Q5_0") as error:
        checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)
    assert "supported types: F32, F16, BF16, Q8_0" in str(error.value)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_an_unsupported_architecture_is_one_clear_error_at_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf_file = write_tiny_llama_gguf(tmp_path / "phi.gguf", Q.F32, architecture="phi3")
    with pytest.raises(GGUFError, match="GGUF architecture 'phi3' is not supported"):
        checkpoint_folder(gguf_file, cache_dir=tmp_path / "cache", progress=False)
    assert main(["serve", "--model", str(gguf_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("error: ") and "'phi3' is not supported" in err


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"GGUF file .*absent.gguf not found"):
        checkpoint_folder(tmp_path / "absent.gguf")


def test_a_folder_with_several_gguf_files_asks_for_one(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        checkpoint_folder(tmp_path)


def test_a_file_that_is_not_gguf_is_named_as_a_file_not_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    with pytest.raises(CheckpointError, match=r"README.md is a file, not a checkpoint"):
        checkpoint_folder(readme)
    assert main(["serve", "--model", str(readme)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is a file, not a checkpoint" in err


def test_a_truncated_gguf_file_is_one_error_line_that_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf_file = write_tiny_llama_gguf(tmp_path / "cut.gguf", Q.F32)
    with gguf_file.open("r+b") as file:
        file.truncate(gguf_file.stat().st_size // 2)
    assert main(["serve", "--model", str(gguf_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"error: --model: {gguf_file} is not a readable GGUF file"), err
    assert "truncated or damaged" in err
