"""Prompt files with images: chat content parts and an image column (JSONL data URIs, a saved
Hugging Face dataset's Image column), read into what the generators consume (PNG bytes in
metadata["images"] beside {"type": "image"} parts), every bad record refused with its place and
reason, and `asyncrl train --check` reading and rendering them for a tiny Idefics3.

    .venv/bin/python -m pytest tests/unit/test_prompt_images.py -q    # about 30 s
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import random
from pathlib import Path

import pytest

from asyncrl.data.images import IMAGES_KEY, ImageLimits, decode_image
from asyncrl.rollout.prompts import MESSAGES_KEY, PromptSourceError, check_source, open_prompts

Image = pytest.importorskip("PIL.Image")


def picture(colour=(200, 20, 20), size=(16, 12), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def first(path: Path | str) -> tuple[str, dict]:
    """The first prompt a generator draws from a one-record source: (text, metadata)."""
    _, text, meta = next(open_prompts(str(path), None, seed=0, id_prefix="g"))
    return text, meta


def jsonl(tmp_path: Path, *records: dict, name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pixels(data: bytes) -> list:
    return list(decode_image(data, ImageLimits()).get_flattened_data())


def test_a_plain_prompt_with_data_uri_images_gets_image_parts_first(tmp_path):
    red, blue = picture((200, 20, 20)), picture((20, 20, 200), fmt="JPEG")
    text, meta = first(jsonl(tmp_path, {"prompt": "colour?", "images": [uri(red), uri(blue, "jpeg")], "target": "r"}))
    assert text == "colour?" and meta["target"] == "r"
    assert meta[MESSAGES_KEY] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "colour?"}]}
    ]
    png, jpeg = meta[IMAGES_KEY]
    assert png == red  # a PNG travels as it was
    assert jpeg.startswith(b"\x89PNG") and pixels(jpeg)[0] == pytest.approx((20, 20, 200), abs=8)  # re-encoded


def test_a_conversation_of_content_parts_keeps_its_parts_and_reads_its_last_user_text(tmp_path):
    convo = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "text", "text": "at"}],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
    ]
    a, b = picture((1, 2, 3)), picture((4, 5, 6))
    text, meta = first(jsonl(tmp_path, {"messages": convo, "images": [uri(a), uri(b)]}))
    assert text == "and this?"
    assert meta[MESSAGES_KEY] == convo and meta[IMAGES_KEY] == [a, b]
    # Parts without images are a conversation like any other: the last user turn's texts, joined.
    texts = [{"type": "text", "text": "look"}, {"type": "text", "text": "at"}]
    text, meta = first(jsonl(tmp_path, {"messages": [convo[0], {"role": "user", "content": texts}]}, name="t.jsonl"))
    assert text == "look\nat" and IMAGES_KEY not in meta


def test_a_conversation_without_image_parts_gets_them_at_its_first_user_turn(tmp_path):
    convo = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    record = {"messages": convo, "image": uri(picture())}
    text, meta = first(jsonl(tmp_path, record))
    assert text == "second"
    assert meta[MESSAGES_KEY] == [
        convo[0],
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "first"}]},
        *convo[2:],
    ]
    assert len(meta[IMAGES_KEY]) == 1 and "image" not in meta  # the column travels as images only
    assert convo[1] == {"role": "user", "content": "first"}  # the record itself is not changed


def test_a_saved_dataset_with_an_image_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    red, jpeg = picture((200, 20, 20)), picture((20, 200, 20), fmt="JPEG")
    data = datasets.Dataset.from_dict(
        {"prompt": ["a?", "b?"], "image": [{"bytes": red, "path": None}, {"bytes": jpeg, "path": "g.jpg"}]}
    ).cast_column("image", datasets.Image())
    data.save_to_disk(str(tmp_path / "ds"))
    found = check_source(str(tmp_path / "ds"), chat_template=True)
    assert found.describe() == "2 records read and valid (2 chat conversations, 2 with images)"
    got = {t: m for _, t, m in itertools.islice(open_prompts(str(tmp_path / "ds"), None, seed=0, id_prefix="g"), 2)}
    assert got["a?"][IMAGES_KEY] == [red]
    assert pixels(got["b?"][IMAGES_KEY][0])[0] == pytest.approx((20, 200, 20), abs=8)
    assert got["b?"][MESSAGES_KEY][0]["content"][0] == {"type": "image"}


def test_a_dataset_row_without_an_image_is_a_text_prompt(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"prompt": ["a?", "b?"], "image": [{"bytes": picture(), "path": None}, None]})
    data.cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "ds"))
    found = check_source(str(tmp_path / "ds"), chat_template=True)
    assert found.describe() == "2 records read and valid (1 chat conversations, 1 with images)"
    got = {t: m for _, t, m in itertools.islice(open_prompts(str(tmp_path / "ds"), None, seed=0, id_prefix="g"), 2)}
    assert got["b?"] == {}  # no images, no conversation, no image column


def test_a_saved_dataset_with_a_list_of_images_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    a, b = picture((9, 9, 9)), picture((90, 90, 90), fmt="BMP")
    data = datasets.Dataset.from_dict(
        {"prompt": ["two?"], "images": [[{"bytes": a, "path": None}, {"bytes": b, "path": None}]]}
    )
    data.cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(str(tmp_path / "ds"))
    _, meta = first(tmp_path / "ds")
    assert meta[IMAGES_KEY][0] == a and pixels(meta[IMAGES_KEY][1])[0] == (90, 90, 90)
    assert [p["type"] for p in meta[MESSAGES_KEY][0]["content"]] == ["image", "image", "text"]


def test_a_decoded_image_value_is_written_as_png_within_the_limits():
    """A dataset that decodes its Image column hands over PIL images."""
    from asyncrl.rollout.prompt_images import PromptRecordError, to_png

    data = to_png(Image.new("RGB", (7, 5), (1, 2, 3)), "row 0: image", ImageLimits())
    assert pixels(data) == [(1, 2, 3)] * 35
    with pytest.raises(
        PromptRecordError, match=r"row 0: image: image 600x600 = 360000 pixels > rollout\.images\.max_pixels"
    ):
        to_png(Image.new("RGB", (600, 600)), "row 0: image", ImageLimits())


def test_a_saved_dataset_of_content_parts_reads_its_parts_as_they_were_written(tmp_path):
    """Arrow stores every part as one struct, so an image part comes back {type, text: None}."""
    datasets = pytest.importorskip("datasets")
    content = [{"type": "image"}, {"type": "text", "text": "which?"}]
    data = datasets.Dataset.from_dict(
        {"messages": [[{"role": "user", "content": content}]], "images": [[{"bytes": picture(), "path": None}]]}
    )
    data.cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(str(tmp_path / "ds"))
    assert data.to_list()[0]["messages"][0]["content"][0] == {"type": "image", "text": None}
    text, meta = first(tmp_path / "ds")
    assert text == "which?" and meta[MESSAGES_KEY] == [{"role": "user", "content": content}]
    assert len(meta[IMAGES_KEY]) == 1


def test_a_dataset_image_that_is_only_a_path_is_refused(tmp_path):
    """An Image column's value as a parquet file stores it ({bytes, path}) with the path alone: the
    file it names (which exists) is never read. (save_to_disk embeds the bytes of a path.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "x.png").write_bytes(picture())
    image = pa.array(
        [{"bytes": None, "path": str(tmp_path / "x.png")}], pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    pq.write_table(pa.table({"prompt": ["a?"], "image": image}), tmp_path / "p.parquet")
    with pytest.raises(PromptSourceError) as e:
        first(tmp_path / "p.parquet")
    assert "row 0: image: an image value without bytes" in str(e.value) and "is not read" in str(e.value)


def noise(fmt: str = "PNG") -> bytes:
    """An image that does not compress: cut short, its pixel data is missing."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (32, 32), random.Random(0).randbytes(32 * 32 * 3)).save(buf, format=fmt)
    return buf.getvalue()


def huge(fmt: str) -> bytes:
    """A few KB that declare 1000x1000 pixels (past max_pixels 512x512) in the header."""
    data = picture(size=(1000, 1000), fmt=fmt)
    assert len(data) < ImageLimits().max_bytes
    return data


REFUSED = [
    ("bad base64", {"prompt": "p", "images": ["data:image/png;base64,@@@"]}, "images[0]: the data URI's base64"),
    ("not an image", {"prompt": "p", "image": uri(b"hello there")}, "image: not an image (none of PNG, JPEG"),
    ("a path", {"prompt": "p", "image": "/etc/hostname"}, 'image: the string "/etc/hostname" is not a \'data:image'),
    ("a url", {"prompt": "p", "image": "https://x/y.png"}, "a file path or URL is not read"),
    (
        "too many bytes",
        {"prompt": "p", "image": uri(b"\x89PNG" + bytes(300 << 10))},
        "> rollout.images.max_bytes 262144",
    ),
    ("PNG header past max_pixels", {"prompt": "p", "image": uri(huge("PNG"))}, "1000x1000 > rollout.images.max_pixels"),
    ("JPEG header past max_pixels", {"prompt": "p", "image": uri(huge("JPEG"), "jpeg")}, "JPEG image 1000x1000"),
    ("a truncated PNG", {"prompt": "p", "image": uri(noise()[:-400])}, "image: PNG does not decode"),
    ("a truncated JPEG", {"prompt": "p", "image": uri(noise("JPEG")[:-400], "jpeg")}, "the JPEG image does not decode"),
    (
        "a dict without bytes",
        {"prompt": "p", "image": {"path": "/etc/hostname"}},
        "without bytes (path '/etc/hostname')",
    ),
    ("images not a list", {"prompt": "p", "images": uri(picture())}, "column 'images' is str, expected a list"),
    ("both columns", {"prompt": "p", "images": [], "image": uri(picture())}, "both an 'images' and an 'image'"),
    ("five images", {"prompt": "p", "images": [uri(picture())] * 5}, "5 images > rollout.images.max_images 4"),
    (
        "more parts than images",
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], "image": uri(picture())},
        "2 image part(s) for 1 image(s) in column 'image'",
    ),
    (
        "parts without images",
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]},
        "1 image part(s) but the record no 'images' column",
    ),
    (
        "a video part",
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "column 'messages': message 0: part 0: part type 'video' is not 'text' or 'image'",
    ),
    (
        "an image part naming a url",
        {"messages": [{"role": "user", "content": [{"type": "image", "url": "http://x"}]}], "image": uri(picture())},
        "message 0: part 0: an image part is {'type': 'image'} alone, got keys ['url']",
    ),
    (
        "a text part without a string",
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "message 1: part 0: a text part is {'type': 'text', 'text': str}",
    ),
]


@pytest.mark.parametrize("record, what", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_record_is_refused_with_its_line_and_reason(tmp_path, record, what):
    path = jsonl(tmp_path, {"prompt": "fine", "image": uri(picture())}, record)
    for read in (lambda: first(path), lambda: check_source(str(path), chat_template=True)):
        with pytest.raises(PromptSourceError) as e:
            read()
        assert str(e.value).startswith(f"rollout.prompts: {path}:2: "), str(e.value)
        assert what in str(e.value)


def test_a_header_past_the_limit_is_refused_before_any_pixel_is_decoded(tmp_path, monkeypatch):
    from PIL import ImageFile

    def never(self):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    for fmt, kind in (("JPEG", "jpeg"), ("GIF", "gif"), ("PNG", "png")):
        path = jsonl(tmp_path, {"prompt": "p", "image": uri(huge(fmt), kind)}, name=f"{kind}.jsonl")
        with pytest.raises(PromptSourceError, match="1000x1000"):
            first(path)


def test_a_plain_prompt_with_images_needs_the_chat_template(tmp_path):
    path = jsonl(tmp_path, {"prompt": "p", "image": uri(picture())})
    assert (
        check_source(str(path), chat_template=True).describe()
        == "1 records read and valid (1 chat conversations, 1 with images)"
    )
    with pytest.raises(PromptSourceError, match=r"rollout\.chat_template=true \(a prompt with images is one"):
        check_source(str(path))


# ------------------------------------------------------------------ the generator's path, --check


@pytest.fixture
def vl_model(tiny_idefics3) -> str:
    return str(tiny_idefics3)


def test_the_generator_encodes_a_file_prompt_with_one_placeholder_per_image(tmp_path, vl_model):
    from transformers import AutoTokenizer

    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.vision_prompts import PromptImageError, VisionModel, with_images

    text, meta = first(jsonl(tmp_path, {"prompt": "colour?", "images": [uri(picture()), uri(picture((0, 0, 9)))]}))
    vision = VisionModel.of(vl_model)
    assert vision is not None
    encode = prompt_encoder(AutoTokenizer.from_pretrained(vl_model), True)
    ids = with_images(encode, vision, ImageLimits())(text, meta)
    assert ids.count(vision.image_token_id) == 2
    with pytest.raises(PromptImageError, match="not a vision-language model"):  # a text model's generator
        with_images(encode, None, ImageLimits())(text, meta)


def test_check_reads_renders_and_refuses_a_prompt_file_with_images(tmp_path, vl_model, capsys, monkeypatch):
    from asyncrl.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = jsonl(tmp_path, {"prompt": "colour?", "image": uri(picture(size=(20, 30)))}, {"prompt": "no image"})
    run = ["train", "configs/demo.yaml", f"rollout.prompts={path}", "rollout.chat_template=true", "--check"]
    vl = [f"rollout.model={vl_model}", "rollout.max_tokens=4", "rollout.engine_max_model_len=64"]
    assert main([*run, *vl]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"check: rollout.prompts={path}: 2 records read and valid (1 chat conversations, 1 with images)" in out
    assert f"check: rollout.prompts: {path}:1: a drawn prompt's 1 image(s) read and decoded (20x30)" in out
    assert "beside the prompt's 1 placeholder token(s)" in out
    assert main(run) == 2  # rollout.model=tiny: a text model
    assert "1 prompt image(s), but rollout.model=tiny is a text model" in capsys.readouterr().err
    assert main([*run, *vl, "rollout.env=countdown_chat", "rollout.env_kwargs={}"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: the record carries images, but rollout.env='countdown_chat' is multi-turn" in err


def test_the_runs_image_limits_are_rollout_images(tmp_path, vl_model, capsys, monkeypatch):
    """A photo past the default max_bytes is refused naming the setting, and taken once the run
    raises it: the prompt file, --check, the generator's encoder and the learner's intake all read
    rollout.images."""
    from asyncrl.cli import main
    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.preflight import check_prompt_source
    from asyncrl.data.codec import RecordError
    from asyncrl.data.images import check_group_images

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    noise = random.Random(0).randbytes(300 * 300 * 3)
    photo = Image.frombytes("RGB", (300, 300), noise)  # ~270 KB as PNG: past the default 256 KiB
    buf = io.BytesIO()
    photo.save(buf, format="JPEG", quality=95)
    path = jsonl(tmp_path, {"prompt": "colour?", "image": uri(buf.getvalue(), "jpeg")})
    base = ["configs/demo.yaml"]
    over = [f"rollout.prompts={path}", "rollout.chat_template=true", f"rollout.model={vl_model}"]
    cfg = load_config(base[0], over)
    with pytest.raises(PromptSourceError, match=r"bytes as PNG > rollout\.images\.max_bytes 262144"):
        check_prompt_source(cfg, "rollout.prompts", str(path), "train")
    big = load_config(base[0], [*over, "rollout.images.max_bytes=1048576"])
    assert big.rollout.images.max_bytes == 1 << 20 and ImageLimits.of(big.rollout.images).max_bytes == 1 << 20
    assert check_prompt_source(big, "rollout.prompts", str(path), "train").images == 1
    limits = ImageLimits.of(big.rollout.images)
    _, _, meta = next(open_prompts(str(path), None, seed=0, id_prefix="g", image_limits=limits))
    (png,) = meta[IMAGES_KEY]
    assert 256 << 10 < len(png) <= 1 << 20
    # the learner's intake holds a record to the same limits: the default would dead-letter it
    with pytest.raises(RecordError, match="max_bytes"):
        check_group_images(meta, ImageLimits())
    assert len(check_group_images(meta, ImageLimits.of(big.rollout.images))) == 1
    # --check reads them with the run's limits
    assert main(["train", *base, *over, "rollout.images.max_bytes=1048576", "rollout.max_tokens=4", "--check"]) == 0
    assert "1 with images" in capsys.readouterr().out
    # and the section's bounds: a published config cannot ask a host to take a 1 GiB image
    for bad in ("rollout.images.max_bytes=1073741824", "rollout.images.max_images=0", "rollout.images.max_pixels=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(base[0], [bad])
