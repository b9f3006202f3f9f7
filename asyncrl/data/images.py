"""Images on the wire: PNG bytes, once per group, bounded, decoded only after checks.

    data = encode_image(img, limits)            # ImageTooLarge past limits.max_bytes
    group.metadata[IMAGES_KEY] = [data]         # the group's prompt images: once, not per sample
    check_group_images(group.metadata, limits)  # RecordError("bad_image", ...) for a bad one
    img = decode_image(data, limits)            # RGB PIL image, or RecordError

Every image read back (from Redis, a prompt file, a published record) is untrusted: the bytes
must be a PNG (the signature is checked before PIL sees them, so no other decoder runs), at
most ``max_bytes`` long, and its header must declare at most ``max_pixels`` pixels before any
pixel is decompressed (a small PNG can inflate to gigabytes); only the chunks its pixels come
from reach PIL (``PIXEL_CHUNKS``: no text or ICC profile is ever inflated). A failure is a RecordError, the
reason the intake dead-letters a record with; never pickle, never a crash.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.data.codec import RecordError

if TYPE_CHECKING:
    from asyncrl.config.rollout import ImagesConfig

IMAGES_KEY = "images"
"""Group metadata key: the prompt's images, a list of PNG bytes, in prompt order."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 256 << 10
    """One encoded image, in bytes."""
    max_pixels: int = 512 * 512
    """One image's width x height, as its header declares it."""
    max_images: int = 4
    """Images per prompt."""

    @classmethod
    def of(cls, section: ImagesConfig) -> ImageLimits:
        """The run's limits (rollout.images)."""
        return cls(max_bytes=section.max_bytes, max_pixels=section.max_pixels, max_images=section.max_images)


class ImageTooLarge(ValueError):
    """A prompt image past the limits, on the writing side: the message says which limit."""


def encode_image(image: Any, limits: ImageLimits) -> bytes:
    """A PIL image as PNG bytes; ImageTooLarge past ``limits``."""
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageTooLarge(
            f"image {width}x{height} = {width * height} pixels > rollout.images.max_pixels {limits.max_pixels}"
        )
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    data = buf.getvalue()
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(
            f"image {width}x{height} is {len(data)} bytes as PNG > rollout.images.max_bytes {limits.max_bytes}"
        )
    return data


def decode_image(data: Any, limits: ImageLimits) -> Any:
    """Untrusted bytes -> an RGB PIL image, or RecordError("bad_image", why)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, bytes):
        raise RecordError("bad_image", f"an image is {type(data).__name__}, expected PNG bytes")
    if len(data) > limits.max_bytes:
        raise RecordError("bad_image", f"image of {len(data)} bytes > rollout.images.max_bytes {limits.max_bytes}")
    if not data.startswith(PNG_SIGNATURE):
        raise RecordError("bad_image", "not a PNG (signature missing)")
    width, height = _declared_size(data)
    if width * height > limits.max_pixels:
        raise RecordError("bad_image", f"image {width}x{height} > rollout.images.max_pixels {limits.max_pixels}")
    try:
        image = Image.open(io.BytesIO(_pixel_chunks(data)), formats=["PNG"])  # reads the header only
        if image.size != (width, height):  # PIL read another header than the first chunk's
            raise RecordError("bad_image", f"image header {width}x{height}, PIL read {image.size}")
        image.load()
        return image.convert("RGB")
    except RecordError:
        raise
    except UnidentifiedImageError:
        # PIL's own message names only the buffer object (its address): say what it refused.
        raise RecordError(
            "bad_image", f"PNG header {width}x{height} does not parse (bit depth, colour type or method)"
        ) from None
    except Exception as e:  # PIL's chunk parsers raise what they raise (IndexError, struct.error, ...)
        raise RecordError("bad_image", f"PNG does not decode: {type(e).__name__}: {e}") from None


PIXEL_CHUNKS = (b"IHDR", b"PLTE", b"tRNS", b"IDAT", b"IEND")
"""The chunks an image's RGB pixels are decoded from. The others (text, ICC profile, animation)
never change them, and PIL inflates the compressed ones before any pixel (zTXt, iTXt: up to 64 MiB
of text an image, from a few KiB): they are left out before PIL sees the bytes."""


def _pixel_chunks(data: bytes) -> bytes:
    """The PNG with its PIXEL_CHUNKS alone, in order (bytes past IEND dropped); RecordError for a
    chunk that runs past the end."""
    out = [PNG_SIGNATURE]
    pos = len(PNG_SIGNATURE)
    while pos < len(data):
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + int.from_bytes(data[pos : pos + 4], "big")  # length, type, data, CRC
        if end > len(data):
            raise RecordError(
                "bad_image", f"PNG does not decode: truncated (chunk {kind!r} at byte {pos} runs past the end)"
            )
        if kind in PIXEL_CHUNKS:
            out.append(data[pos:end])
        if kind == b"IEND":
            break
        pos = end
    return b"".join(out)


def _declared_size(data: bytes) -> tuple[int, int]:
    """The width and height the first chunk (IHDR, 13 bytes) declares, read before PIL sees the
    bytes: a size with no pixel is refused here, and one past max_pixels never reaches a decoder."""
    ihdr = data[len(PNG_SIGNATURE) : len(PNG_SIGNATURE) + 16]
    if len(ihdr) < 16 or ihdr[4:8] != b"IHDR" or int.from_bytes(ihdr[:4], "big") != 13:
        raise RecordError("bad_image", "PNG without an IHDR header chunk first")
    width, height = int.from_bytes(ihdr[8:12], "big"), int.from_bytes(ihdr[12:16], "big")
    if width == 0 or height == 0:
        raise RecordError("bad_image", f"image {width}x{height} has no pixels")
    return width, height


def images_of(metadata: dict[str, Any], limits: ImageLimits) -> list[bytes]:
    """The group's image bytes, checked for shape and count (not decoded)."""
    images = metadata.get(IMAGES_KEY, [])
    if not isinstance(images, list):
        raise RecordError("bad_image", f"metadata[{IMAGES_KEY!r}] is {type(images).__name__}, expected a list")
    if len(images) > limits.max_images:
        raise RecordError("bad_image", f"{len(images)} images > rollout.images.max_images {limits.max_images}")
    for i, data in enumerate(images):
        if not isinstance(data, bytes):
            raise RecordError("bad_image", f"images[{i}] is {type(data).__name__}, expected PNG bytes")
    return images


def check_group_images(metadata: dict[str, Any], limits: ImageLimits) -> list[Any]:
    """Every image of a group's metadata decoded (RGB PIL images), or RecordError naming the bad one."""
    out = []
    for i, data in enumerate(images_of(metadata, limits)):
        try:
            out.append(decode_image(data, limits))
        except RecordError as e:
            raise RecordError("bad_image", f"images[{i}]: {e.detail}") from None
    return out
