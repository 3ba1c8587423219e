"""Images through a served 2P1D cluster, driven by the official `openai` client.

One `disagg serve` for the module on a tiny Nemotron Omni checkpoint (vision
tower and projector included), Python transceiver, prefix-aware router: a
repeated image+text goes back to the context worker that encoded the image
(block reuse stays off for the hybrid model, so no KV block is shared).
Conditional disaggregation is set between the two prompt lengths used, so
the longer chat runs disaggregated (the context worker encodes the image and
prefills; the generation worker only pulls the cache) and the shorter one
runs whole on the generation worker. A second, aggregated-only cluster
(`context_servers.num_instances: 0`, its generation instance two
tensor-parallel ranks) serves the long chat on the same weights with the VL
V2 tiling format. All give transformers' `NemotronH_Omni_Reasoning_V3` greedy
text on the same pixels; another image gives another answer; the repeated
image is an encoder-cache hit; bad images and images on /v1/completions are
400s naming the part, and the server keeps serving.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml
from PIL import Image

from benchmarks.serve_process import ServeProcess

MAX_TOKENS = 8
# The short prompt (39 tokens) runs locally, the long one (55) disaggregated.
MAX_LOCAL_PREFILL = 45
SHORT = "Describe {image} please."
LONG = "Look closely at this picture {image} and tell me what it shows, in a few words."


def tiny_omni(out: Path, image_format: str) -> Path:
    from models.embedded.writer import ensure_checkpoint

    # A wider initialization than the default, so the image visibly steers
    # the tiny model's answer. The weights do not depend on the image format.
    return ensure_checkpoint(
        out,
        "nemotron_vl",
        "tiny",
        vl_architecture="NemotronH_Omni_Reasoning_V3",
        initializer_range=0.1,
        image_format=image_format,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_omni(tmp_path_factory.mktemp("vl") / "tiny-omni", "dynamic")


def serve_config(checkpoint: Path, num_context: int) -> dict[str, Any]:
    return {
        "model": str(checkpoint),
        "hostname": "127.0.0.1",
        "port": 0,
        "max_request_body_bytes": 4 << 20,
        "router": {"type": "prefix_aware"},
        "conditional_disagg": {"max_local_prefill_length": MAX_LOCAL_PREFILL},
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"manager": "auto", "block_size": 16, "max_tokens": 1024},
        "max_num_tokens": 256,
        "context_servers": {"num_instances": num_context, "max_batch_size": 4},
        "generation_servers": {"num_instances": 1, "max_batch_size": 4},
    }


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    path = tmp_path_factory.mktemp("config") / "1p1d-images.yaml"
    path.write_text(yaml.safe_dump(serve_config(checkpoint, num_context=2)))
    with ServeProcess(path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return NemotronH_Omni_Reasoning_V3.from_pretrained(checkpoint, dtype=torch.float32).eval()


def picture(seed: int, width: int = 64) -> Image.Image:
    pixels = torch.randint(0, 256, (64, width, 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.byte().numpy())


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(template: str, url: str) -> list[dict[str, Any]]:
    before, after = template.split("{image}")
    parts = [
        {"type": "text", "text": before},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": after},
    ]
    return [{"role": "user", "content": parts}]


def expected_text(checkpoint: Path, reference: Any, template: str, image: Image.Image) -> str:
    """transformers' greedy answer on the same pixels, prompt and tokenizer."""
    return expected_chat_text(checkpoint, reference, [template], image)


def expected_chat_text(
    checkpoint: Path, reference: Any, turns: list[str], image: Image.Image
) -> str:
    """transformers' greedy answer to a chat whose first user turn holds the
    image (`turns`: user, assistant, user, ... texts, the first with {image})."""
    from transformers import AutoTokenizer

    from models.hf_config import load_model_config
    from models.image_processing import (
        image_prompt_text,
        load_image_processor_config,
        preprocess_image,
    )

    vision = load_model_config(checkpoint).vision
    assert vision is not None
    processing = load_image_processor_config(checkpoint, vision)
    grid = processing.patch_grid(image.height, image.width)
    placeholder = image_prompt_text(processing.num_image_tokens(grid), "<image>")
    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text}
        for i, text in enumerate([turns[0].format(image=placeholder), *turns[1:]])
    ]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]),
            pixel_values=preprocess_image(image, grid, processing),
            # Each tile of the VL V2 format is one image to transformers' tower.
            image_grid_hw=torch.tensor(processing.encoder_grids(grid)),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def test_aggregated_only_cluster_gives_transformers_text_on_tiles(
    reference: Any, tmp_path: Path
) -> None:
    """No context worker at all: the generation worker encodes and prefills,
    here on the VL V2 tiling format (2 x 1 tiles + thumbnail) and as two
    tensor-parallel ranks (the image path on rank 0, the backbone split)."""
    tiled = tiny_omni(tmp_path / "tiny-omni-tiles", "tiles")
    config = serve_config(tiled, num_context=0)
    config["generation_servers"]["tensor_parallel_size"] = 2
    path = tmp_path / "aggregated-images.yaml"
    path.write_text(yaml.safe_dump(config))
    fish = picture(5, width=128)
    with ServeProcess(path) as aggregated:
        local = openai.OpenAI(base_url=aggregated.url, api_key="unused", timeout=120)
        assert ask(local, LONG, data_url(fish)) == expected_text(tiled, reference, LONG, fish)
        assert metric(aggregated, "disagg_routed_requests_total", phase="whole") == 1
        slots = [metric(aggregated, "disagg_rank_mamba_slots", rank=r, state="total") for r in "01"]
        assert slots[0] > 0 and slots[0] == slots[1]


def ask(client: openai.OpenAI, template: str, url: str) -> str:
    name = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=name,
        messages=messages(template, url),
        max_tokens=MAX_TOKENS,
        temperature=0.0,  # type: ignore[arg-type]
    )
    return response.choices[0].message.content or ""


def metric(server: ServeProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_disaggregated_image_chat_gives_transformers_text(
    client: openai.OpenAI, server: ServeProcess, checkpoint: Path, reference: Any
) -> None:
    cat, dog = picture(1), picture(2)
    answer = ask(client, LONG, data_url(cat))
    assert answer == expected_text(checkpoint, reference, LONG, cat)
    other = ask(client, LONG, data_url(dog))
    assert other == expected_text(checkpoint, reference, LONG, dog)
    assert other != answer
    assert metric(server, "disagg_routed_requests_total", phase="context") >= 2
    # The same image again, streamed: the context worker's encoder skips the tower.
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages(LONG, data_url(cat)),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == answer
    deadline = time.monotonic() + 10
    while metric(server, "disagg_encoder_cache_images", result="hit") < 1:
        assert time.monotonic() < deadline, "no encoder-cache hit in /metrics"
        time.sleep(0.2)


def test_local_image_chat_gives_transformers_text(
    client: openai.OpenAI, server: ServeProcess, checkpoint: Path, reference: Any
) -> None:
    before = metric(server, "disagg_routed_requests_total", phase="whole")
    bird = picture(3)
    assert ask(client, SHORT, data_url(bird)) == expected_text(checkpoint, reference, SHORT, bird)
    assert metric(server, "disagg_routed_requests_total", phase="whole") == before + 1


def test_bad_images_are_400s_and_the_server_keeps_serving(
    client: openai.OpenAI, server: ServeProcess
) -> None:
    name = client.models.list().data[0].id
    cases = [
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "cannot be decoded"),
        ("https://example.com/cat.png", "media.allow_remote_urls"),
        ("file:///etc/hostname", "media.allowed_local_media_path"),
    ]
    for url, reason in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=name,
                messages=messages(SHORT, url),
                max_tokens=2,  # type: ignore[arg-type]
            )
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == "messages[0].content[1]", error
        assert reason in error["message"]
    # /v1/completions takes no images; its 400 points at the chat endpoint.
    with pytest.raises(openai.BadRequestError, match="/v1/chat/completions") as refused:
        client.completions.create(model=name, prompt="Describe <image> please.", max_tokens=2)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "prompt"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(openai.BadRequestError, match="'input_audio' are not supported"):
        client.chat.completions.create(model=name, messages=audio, max_tokens=2)  # type: ignore[arg-type]
    assert ask(client, SHORT, data_url(picture(4)))


def test_prefix_aware_sends_a_repeated_image_to_its_encoder(
    client: openai.OpenAI, server: ServeProcess
) -> None:
    """Two context workers with equal loads would take turns; the encoder-cache
    events steer the second fish to the worker that encoded the first."""
    workers = ("context-0", "context-1")

    def routed() -> dict[str, float]:
        return {w: metric(server, "disagg_routed_requests_total", worker=w) for w in workers}

    def encoded() -> float:
        # The context workers' alone: an earlier request that ran whole on the
        # generation worker may still be reporting its image.
        return sum(metric(server, "disagg_router_encoded_images", worker=w) for w in workers)

    before, known = routed(), encoded()
    hits = metric(server, "disagg_routed_cache_hits_total", phase="context", cache="encoder")
    fish = data_url(picture(6))
    first = ask(client, LONG, fish)
    deadline = time.monotonic() + 10
    while encoded() < known + 1:
        assert time.monotonic() < deadline, "the router never heard of the encoded image"
        time.sleep(0.2)
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages(LONG, fish),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    assert response.choices[0].message.content == first
    gains = sorted(routed()[w] - before[w] for w in workers)
    assert gains == [0, 2], gains
    after = metric(server, "disagg_routed_cache_hits_total", phase="context", cache="encoder")
    assert after == hits + 1
    # Prefix reuse stays off for the hybrid model: nothing came from a KV block.
    assert response.usage is not None and response.usage.prompt_tokens_details is None
    assert metric(server, "disagg_routed_cache_hits_total", cache="kv") == 0
