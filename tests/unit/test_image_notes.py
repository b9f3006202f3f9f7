"""A prompt's in-flight note carries its images: a prompt within the image limits must be read
back whole by every reader of notes (a successor's take-over, a stale drop's re-issue)."""

from __future__ import annotations

import io

import msgpack
import numpy as np

from asyncrl.data.images import IMAGES_KEY, ImageLimits, check_group_images
from asyncrl.queue.readback import parse_note
from asyncrl.queue.records import note_bound, unpack_note
from asyncrl.queue.reissue import note_of, parse_reissued, reissue_of


def _largest_images(limits: ImageLimits) -> list[bytes]:
    """limits.max_images PNGs of noise, each the largest square within limits.max_bytes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    side = int((limits.max_bytes / 3) ** 0.5)  # noise does not compress: about 3 bytes a pixel
    while True:
        out = []
        for _ in range(limits.max_images):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
            out.append(buf.getvalue())
        if max(len(d) for d in out) <= limits.max_bytes:
            return out
        side -= 1


def test_a_note_of_a_prompt_with_the_largest_images_allowed_reads_back():
    limits = ImageLimits()
    images = _largest_images(limits)
    assert len(check_group_images({IMAGES_KEY: images}, limits)) == limits.max_images
    metadata = {IMAGES_KEY: images, "answer": "red"}
    # as asyncrl.rollout.production writes it
    text = "<image>" * limits.max_images + "which colours? " * 400  # a question of a few KiB
    raw = msgpack.packb({"text": text, "metadata": metadata}, use_bin_type=True)
    note = parse_note(unpack_note(raw))  # a successor's take-over (asyncrl.rollout.recovery)
    assert note.metadata[IMAGES_KEY] == images
    read = note_of("1-1", raw)  # a stale drop's re-issue reads the stream entry's note
    assert read is not None and read["metadata"][IMAGES_KEY] == images
    again = reissue_of("p-1", read, max_reissues=2)
    assert again is not None
    entry = msgpack.packb(
        {"prompt_id": again.prompt_id, "text": again.text, "metadata": again.metadata}, use_bin_type=True
    )
    popped = parse_reissued(unpack_note(entry))  # a generator's pop_reissued
    assert popped is not None and popped.metadata[IMAGES_KEY] == images


def test_a_run_with_larger_image_limits_reads_back_its_larger_notes():
    """rollout.images raised: a note past the default bound is read whole under the run's limits,
    and still refused past them (a forged note cannot claim more than the run allows)."""
    import pytest

    limits = ImageLimits(max_bytes=1 << 20, max_pixels=1024 * 1024, max_images=3)
    images = _largest_images(limits)
    raw = msgpack.packb({"text": "<image><image><image>colours?", "metadata": {IMAGES_KEY: images}}, use_bin_type=True)
    assert len(raw) > note_bound()  # past what the default limits' bound takes
    with pytest.raises(ValueError, match="bytes >"):
        unpack_note(raw)
    assert note_of("1-1", raw) is None  # the default bound: unreadable, not re-issued
    assert parse_note(unpack_note(raw, limits)).metadata[IMAGES_KEY] == images
    read = note_of("1-1", raw, limits)
    assert read is not None and read["metadata"][IMAGES_KEY] == images
    with pytest.raises(ValueError, match="bytes >"):
        unpack_note(raw + bytes(4 << 20), limits)
