"""Images of a prompt file's records: chat content parts and an image column, read strictly.

    text = content_text(message["content"], where)        # a message's text; its parts checked
    messages, images = record_images(record, messages, where, ImageLimits())
    # images: PNG bytes (asyncrl.data.images), one per {"type": "image"} part of ``messages``

A message's content is a string or a list of parts, as Hugging Face chat templates take them:
``{"type": "text", "text": str}`` and ``{"type": "image"}`` (the template writes the model's own
placeholder for an image part). A record's images are its ``images`` column (a list) or its
``image`` column (one image; null or an empty list: none); each is
- bytes: a PNG, or a JPEG / WebP / GIF / BMP that is re-encoded to PNG (no other decoder runs);
- a Hugging Face ``datasets`` Image value: ``{"bytes": ..., "path": ...}`` (its bytes are
  read, never its path), or a PIL image when the dataset decodes;
- in JSON, a ``data:image/<format>;base64,...`` string.
A string naming a file or a URL is refused: data must not make a host read files or the network.
A record with images whose conversation has no image part gets one ``{"type": "image"}`` part
per image at the start of its first user turn (TRL's convention); otherwise the parts and the
images must be as many. Each image is checked before its pixels are decoded: its encoded size
within ``max_bytes`` and the size its header declares within ``max_pixels`` (a small file can
inflate to gigabytes); then it is decoded once and written as PNG within the same limits.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from typing import Any

from asyncrl.data.codec import RecordError
from asyncrl.data.images import PNG_SIGNATURE, ImageLimits, ImageTooLarge, decode_image, encode_image

IMAGE_COLUMNS = ("images", "image")
"""A record's image column: a list of images, or one image."""
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The decoders PIL may run on a prompt file's image bytes (never EPS, which runs Ghostscript)."""
_DATA_URI = re.compile(r"data:image/([a-z0-9.+-]+);base64,", re.IGNORECASE)
IMAGE_PART = {"type": "image"}
CHAT_ROLES = ("system", "user", "assistant", "tool")


class PromptRecordError(ValueError):
    """A record's content parts or images are malformed: the message names the record, message,
    part or image, and why. (asyncrl.rollout.prompts raises it as its PromptSourceError.)"""


def chat_text(messages: list[Any], where: str) -> str:
    """The reward's prompt text of a chat conversation (its last user turn's text), after checking
    every message is {role: one of CHAT_ROLES, content: a string or a list of text and image
    parts}."""
    if not messages:
        raise PromptRecordError(f"{where}: an empty conversation")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise PromptRecordError(f"{where}: message {k} is {short_json(m)}, expected {{role, content}}")
        if m["role"] not in CHAT_ROLES:
            raise PromptRecordError(f"{where}: message {k}: role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(m["content"], (str, list)):
            kind = _json_kind(m["content"])
            raise PromptRecordError(f"{where}: message {k}: content holds {kind}, expected a string or a list of parts")
    if messages[-1]["role"] == "assistant":
        raise PromptRecordError(f"{where}: the conversation ends with an assistant turn (the engine writes that one)")
    texts = [content_text(m["content"], f"{where}: message {k}") for k, m in enumerate(messages)]
    users = [t for t, m in zip(texts, messages, strict=True) if m["role"] == "user"]
    if not users:
        raise PromptRecordError(f"{where}: the conversation has no user turn")
    return users[-1]


def content_text(content: Any, where: str) -> str:
    """A message's text: the string, or its text parts joined by newlines, after checking each part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptRecordError(f"{where}: content is {type(content).__name__}, expected a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}: part {j}"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PromptRecordError(f"{at} is {short_json(part)}, expected {{'type': 'text' | 'image', ...}}")
        keys = {k for k, v in part.items() if v is not None}  # a dataset's parts share one struct's keys
        if part["type"] == "text":
            if keys != {"type", "text"} or not isinstance(part["text"], str):
                raise PromptRecordError(f"{at}: a text part is {{'type': 'text', 'text': str}}, got {short_json(part)}")
            texts.append(part["text"])
        elif part["type"] == "image":
            if keys != {"type"}:
                extra = sorted(keys - {"type"})
                raise PromptRecordError(
                    f"{at}: an image part is {{'type': 'image'}} alone, got keys {extra}: "
                    f"the images go in the record's 'images' (or 'image') column"
                )
        else:
            raise PromptRecordError(f"{at}: part type {part['type']!r} is not 'text' or 'image'")
    return "\n".join(texts)


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many {"type": "image"} parts a (checked) conversation holds."""
    return sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "image")


def record_images(
    record: dict[str, Any], messages: list[dict[str, Any]] | None, text: str, where: str, limits: ImageLimits
) -> tuple[list[dict[str, Any]] | None, list[bytes]]:
    """(the conversation, with image parts inserted when it had none; the record's images as PNG
    bytes, [] without any). ``messages`` is None for a plain string prompt ``text``, which becomes
    a one-turn conversation when the record has images. PromptRecordError for a bad image or a
    count mismatch."""
    columns = [c for c in IMAGE_COLUMNS if c in record]
    if len(columns) > 1:
        raise PromptRecordError(f"{where}: both an 'images' and an 'image' column: one of them")
    if messages is not None:
        messages = [_clean(m) for m in messages]
    parts = image_parts(messages) if messages is not None else 0
    if not columns:
        if parts:
            raise PromptRecordError(
                f"{where}: the conversation has {parts} image part(s) but the record no 'images' column"
            )
        return messages, []
    column = columns[0]
    raw = record[column]
    if raw is None:  # a dataset's row without an image (its column is nullable)
        values = []
    elif column == "images":
        if not isinstance(raw, list):
            raise PromptRecordError(f"{where}: column 'images' is {type(raw).__name__}, expected a list of images")
        values = raw
    else:
        values = [raw]
    if len(values) > limits.max_images:
        raise PromptRecordError(f"{where}: {len(values)} images > rollout.images.max_images {limits.max_images}")
    images = [
        to_png(v, f"{where}: {column}" + (f"[{i}]" if column == "images" else ""), limits) for i, v in enumerate(values)
    ]
    if not parts and images:
        if messages is None:
            return [
                {"role": "user", "content": [*(dict(IMAGE_PART) for _ in images), {"type": "text", "text": text}]}
            ], images
        return _with_parts(messages, len(images), where), images
    if parts != len(images):
        raise PromptRecordError(
            f"{where}: the conversation has {parts} image part(s) for {len(images)} image(s) in column {column!r}: "
            f"each image needs one {{'type': 'image'}} part (or none at all, and they are inserted)"
        )
    return messages, images


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """A (checked) message whose parts hold only their own keys: a dataset stores every part as
    one struct, so an image part arrives as {"type": "image", "text": None}."""
    if not isinstance(message["content"], list):
        return message
    return {**message, "content": [{k: v for k, v in p.items() if v is not None} for p in message["content"]]}


def _with_parts(messages: list[dict[str, Any]], n: int, where: str) -> list[dict[str, Any]]:
    """The conversation with ``n`` image parts at the start of its first user turn (a copy)."""
    out = [dict(m) for m in messages]  # the record's own dicts are not changed
    first = next((m for m in out if m["role"] == "user"), None)
    if first is None:  # chat_text refuses this first; kept for a direct caller
        raise PromptRecordError(f"{where}: the conversation has no user turn for its images")
    content = first["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    first["content"] = [dict(IMAGE_PART) for _ in range(n)] + text
    return out


def to_png(value: Any, where: str, limits: ImageLimits) -> bytes:
    """One image value (see the module doc) as checked PNG bytes; PromptRecordError naming why."""
    if isinstance(value, str):
        data = _data_uri(value, where, limits)
    elif isinstance(value, dict):
        raw = value.get("bytes")
        if raw is None:
            path = value.get("path")
            raise PromptRecordError(
                f"{where}: an image value without bytes (path {path!r}): a file a record names is not read "
                f"(data must not make a host read files); store the image's bytes in the dataset"
            )
        if set(value) - {"bytes", "path"} or not isinstance(raw, bytes):
            raise PromptRecordError(
                f"{where}: expected an image value {{'bytes': bytes, 'path': ...}}, got {short_json(value)}"
            )
        data = raw
    elif isinstance(value, bytes):
        data = value
    elif _is_pil(value):
        return _encode(value, where, limits)
    else:
        raise PromptRecordError(f"{where}: an image is {type(value).__name__}, expected bytes or a data URI")
    return _bytes_png(data, where, limits)


def _data_uri(value: str, where: str, limits: ImageLimits) -> bytes:
    m = _DATA_URI.match(value)
    if m is None:
        raise PromptRecordError(
            f"{where}: the string {short_json(value)} is not a 'data:image/<format>;base64,...' URI "
            f"(a file path or URL is not read: data must not make a host read files)"
        )
    payload = value[m.end() :]
    if len(payload) * 3 // 4 > limits.max_bytes + 2:  # refused before decoding it
        size = len(payload) * 3 // 4
        raise PromptRecordError(f"{where}: image of about {size} bytes > rollout.images.max_bytes {limits.max_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PromptRecordError(f"{where}: the data URI's base64 does not decode: {e}") from None


def _bytes_png(data: bytes, where: str, limits: ImageLimits) -> bytes:
    """Encoded image bytes -> checked PNG bytes: a PNG through decode_image (kept as it is),
    another format's declared size checked from its header before any pixel is decoded."""
    if len(data) > limits.max_bytes:
        raise PromptRecordError(f"{where}: image of {len(data)} bytes > rollout.images.max_bytes {limits.max_bytes}")
    if data.startswith(PNG_SIGNATURE):
        try:
            decode_image(data, limits)
        except RecordError as e:
            raise PromptRecordError(f"{where}: {e.detail}") from None
        return data
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))  # reads the header only
    except UnidentifiedImageError:
        raise PromptRecordError(f"{where}: not an image (none of {', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise PromptRecordError(f"{where}: the image header does not parse: {type(e).__name__}: {e}") from None
    width, height = image.size
    if width * height > limits.max_pixels or width * height == 0:
        raise PromptRecordError(
            f"{where}: {image.format} image {width}x{height} (as its header declares) is not within "
            f"1..rollout.images.max_pixels {limits.max_pixels}"
        )
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise PromptRecordError(f"{where}: the {image.format} image does not decode: {type(e).__name__}: {e}") from None
    return _encode(image, where, limits)


def _encode(image: Any, where: str, limits: ImageLimits) -> bytes:
    try:
        return encode_image(image, limits)
    except ImageTooLarge as e:
        raise PromptRecordError(f"{where}: {e}") from None


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def short_json(value: Any, width: int = 60) -> str:
    """``value`` as JSON for an error message (a non-JSON value as ``<type>``), cut to ``width``."""
    text = json.dumps(value, default=lambda v: f"<{type(v).__name__}>")
    return text if len(text) <= width else text[: width - 3] + "..."


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), type(value).__name__
    )
