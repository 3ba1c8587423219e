"""engine.image_encoder: placeholder rows per chunk, and the encoder cache."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine.image_encoder import ImageChunk, ImageEncoder
from engine.model_runner import ModelRunner, StepInput
from engine.multimodal import EncoderCacheEvent, ImageInput
from models.embedded.writer import write_checkpoint
from models.host_batch import HostBatch
from models.host_reads import count_host_reads
from models.image_processing import load_image_processor_config, preprocess_image
from models.loader import load_model
from models.nemotron_vl import NemotronVLForCausalLM


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[NemotronVLForCausalLM, Path]:
    path = write_checkpoint(tmp_path_factory.mktemp("vl"), "nemotron_vl")
    loaded, _ = load_model(path)
    assert isinstance(loaded, NemotronVLForCausalLM)
    return loaded, path


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    pixels = torch.randint(
        0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(sum(colour))
    )
    Image.fromarray(pixels.byte().numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def encoder_for(model: tuple[NemotronVLForCausalLM, Path]) -> ImageEncoder:
    vl, path = model
    assert vl.vision is not None
    return ImageEncoder(vl, load_image_processor_config(path, vl.vision), torch.device("cpu"))


def image_at(data: bytes, offset: int, encoder: ImageEncoder) -> ImageInput:
    grid = encoder.processing.patch_grid(48, 64)
    vl = encoder.model
    assert isinstance(vl, NemotronVLForCausalLM) and vl.vision is not None
    return ImageInput(
        hashlib.sha256(data).digest(), data, grid, offset, vl.vision.num_image_tokens(grid)
    )


def test_rows_of_a_chunked_image_are_its_embeddings_in_order(
    model: tuple[NemotronVLForCausalLM, Path],
) -> None:
    encoder = encoder_for(model)
    image = image_at(png((1, 2, 3)), offset=3, encoder=encoder)
    assert image.num_tokens == 4  # a 64 x 48 image: 4 x 4 patches, 2 x 2 after the shuffle
    pixels = preprocess_image(Image.open(io.BytesIO(image.data)), image.grid_hw, encoder.processing)
    with torch.inference_mode():
        expected = model[0].encode_image(pixels, image.grid_hw)
    # Two sequences in one step; the image's tokens split over two steps.
    first = encoder.rows([ImageChunk([image], 0, 5, first_row=10)])
    assert first is not None
    assert first[0].tolist() == [13, 14]
    torch.testing.assert_close(first[1], expected[:2])
    second = encoder.rows([ImageChunk([], 0, 3, 0), ImageChunk([image], 5, 9, first_row=3)])
    assert second is not None
    assert second[0].tolist() == [3, 4]
    torch.testing.assert_close(second[1], expected[2:])
    assert encoder.rows([ImageChunk([image], 7, 12, 0)]) is None
    assert (encoder.stats.misses, encoder.stats.hits) == (1, 1)


class RecordingFollowers:
    def __init__(self) -> None:
        self.steps: list[StepInput] = []

    def send(self, step: StepInput) -> None:
        self.steps.append(step)

    def abandon(self) -> None:
        raise AssertionError("the step did not fail")


def test_tensor_parallel_ranks_learn_the_image_rows_without_a_host_read(
    model: tuple[NemotronVLForCausalLM, Path],
) -> None:
    """Rank 0 tells the other ranks which rows are images from the host
    counts (`placeholder_rows`), not by reading back the device index tensor."""
    encoder = encoder_for(model)
    image = image_at(png((4, 5, 6)), offset=3, encoder=encoder)
    chunks = [ImageChunk([], 0, 3, 0), ImageChunk([image], 2, 6, first_row=3)]
    encoded = encoder.rows(chunks)  # the vision tower runs here, not in the count below
    assert encoded is not None
    followers = RecordingFollowers()
    runner = ModelRunner(
        None,
        None,
        None,
        16,
        None,
        image_encoder=encoder,
        followers=followers,  # type: ignore[arg-type]
    )
    runner._forward = lambda step, images: (torch.empty(0), None)  # type: ignore[method-assign]
    step = StepInput(HostBatch.pack(
        input_ids=[0] * 7, positions=[0, 1, 2, 2, 3, 4, 5], query_start_loc=[0, 3, 7],
        seq_lens=[3, 6], context_lens=[0, 2], block_tables=[[1], [2]], slot_mapping=list(range(7)),
        block_size=16, mamba_slots=None, logits_indices=[2, 6],
    ))  # fmt: skip
    with count_host_reads("cpu") as reads:
        runner._run(step, chunks)
    assert reads.count == 0, reads.names
    assert followers.steps[0].image_rows == encoded[0].tolist() == [4, 5, 6]


def test_the_same_image_again_is_a_cache_hit(model: tuple[NemotronVLForCausalLM, Path]) -> None:
    encoder = encoder_for(model)
    cat, dog = png((1, 1, 1)), png((9, 9, 9))
    first = encoder.embeddings(image_at(cat, 0, encoder))
    again = encoder.embeddings(image_at(cat, 7, encoder))
    other = encoder.embeddings(image_at(dog, 0, encoder))
    assert (encoder.stats.misses, encoder.stats.hits) == (2, 1)
    assert again is first and not torch.equal(first, other)


def test_cache_keeps_the_most_recent_images_within_its_bytes(
    model: tuple[NemotronVLForCausalLM, Path],
) -> None:
    encoder = encoder_for(model)
    one = encoder.embeddings(image_at(png((1, 0, 0)), 0, encoder))
    encoder.cache_bytes = one.numel() * one.element_size() * 2
    images = [image_at(png((c, 0, 0)), 0, encoder) for c in (1, 2, 3)]
    for image in images:
        encoder.embeddings(image)
    assert encoder.stats.misses == 3  # the first image was cached; 2 and 3 were not
    encoder.embeddings(images[0])  # evicted by 2 and 3
    assert encoder.stats.misses == 4


def test_an_image_without_its_bytes_cannot_be_encoded(
    model: tuple[NemotronVLForCausalLM, Path],
) -> None:
    encoder = encoder_for(model)
    image = image_at(png((5, 5, 5)), 0, encoder).without_data()
    with pytest.raises(ValueError, match="prefilled on a context worker"):
        encoder.embeddings(image)


def test_cache_events_name_the_images_stored_and_evicted(
    model: tuple[NemotronVLForCausalLM, Path],
) -> None:
    encoder = encoder_for(model)
    images = [image_at(png((c, 1, 0)), 0, encoder) for c in (1, 2)]
    one = encoder.embeddings(images[0])
    encoder.embeddings(images[0])  # a hit changes nothing
    assert encoder.drain_events() == [EncoderCacheEvent(True, images[0].content_hash)]
    assert encoder.drain_events() == []
    encoder.cache_bytes = one.numel() * one.element_size()
    encoder.embeddings(images[1])
    assert encoder.drain_events() == [
        EncoderCacheEvent(True, images[1].content_hash),
        EncoderCacheEvent(False, images[0].content_hash),
    ]
