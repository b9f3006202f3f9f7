"""Vision-language prompts on real small parts: the tiny Qwen2-VL, its tokenizer and PIL image
processor, the colour task, the image wire checks and the learner's one-pass log-probs."""

from __future__ import annotations

import random
import struct
import zlib

import numpy as np
import pytest

from asyncrl.data.codec import RecordError
from asyncrl.data.images import (
    IMAGES_KEY,
    PNG_SIGNATURE,
    ImageLimits,
    ImageTooLarge,
    check_group_images,
    decode_image,
    encode_image,
)
from asyncrl.rollout.envs.colour import COLOURS, ColourEnv

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from asyncrl.rollout.tiny_vl import write_tiny_vl_model

    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture(scope="module")
def prompter(tiny_vl):
    from asyncrl.data.vision import VisionPrompter

    return VisionPrompter.load(str(tiny_vl))


@pytest.fixture(scope="module")
def model(tiny_vl):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_vl)).float().eval()


def _messages():
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


def test_colour_env_draws_the_named_colour_and_scores_the_name():
    env = ColourEnv()
    limits = ImageLimits()
    seen = set()
    for seed in range(20):
        prompt, meta = env.make_prompt(random.Random(seed))
        (image,) = check_group_images(meta, limits)
        pixels = {tuple(p) for p in np.asarray(image).reshape(-1, 3)}
        assert COLOURS[meta["target"]] in pixels, meta["target"]
        assert set(pixels) <= {COLOURS[meta["target"]], (128, 128, 128)}
        assert env.reward(prompt, meta["target"], meta) == 1.0
        assert env.reward(prompt, "zzz", meta) < 0.5
        seen.add(meta["target"])
    assert seen == set(COLOURS)


def test_prompt_expands_the_image_pad_to_one_token_per_merged_patch(prompter):
    env = ColourEnv(size=56)
    _, meta = env.make_prompt(random.Random(0))
    vp = prompter.encode(_messages(), check_group_images(meta, ImageLimits()))
    assert vp.image_grid_thw.tolist() == [[1, 4, 4]]  # 56x56 -> 4x4 patches of 14
    assert int((vp.input_ids == prompter.image_pad_id).sum()) == 4  # 2x2 merge
    assert vp.pixel_values.shape[0] == 16
    assert prompter.tokenizer.decode(vp.input_ids[-7:].tolist()) == "colour?"
    with pytest.raises(ValueError, match="1 image parts but 2 images"):
        prompter.encode(_messages(), check_group_images(meta, ImageLimits()) * 2)


def test_the_image_changes_the_models_output(prompter, model):
    """The vision tower is wired in: two colours give two different next-token distributions."""
    from asyncrl.learner.vision import response_logprobs

    env = ColourEnv()
    out = []
    for name in ("red", "blue"):
        vp = prompter.encode(_messages(), [env.draw(name, random.Random(0))])
        with torch.no_grad():
            out.append(response_logprobs(model, vp, np.array([prompter.tokenizer.convert_tokens_to_ids("r")])))
    assert not torch.allclose(out[0], out[1])


def test_learner_one_pass_logprobs_equal_token_by_token_decoding(prompter, model):
    """The learner scores prompt+response in one pass; a sampler decodes with a KV cache and
    its own multimodal RoPE offsets. Both must give the same log-probs (the parity premise)."""
    from asyncrl.learner.vision import mm_token_type_ids, response_logprobs

    env = ColourEnv()
    _, meta = env.make_prompt(random.Random(3))
    vp = prompter.encode(_messages(), check_group_images(meta, ImageLimits()))
    torch.manual_seed(0)
    ids = torch.as_tensor(vp.input_ids[None].astype(np.int64))
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            mm_token_type_ids=mm_token_type_ids(model, ids),
            pixel_values=torch.as_tensor(vp.pixel_values),
            image_grid_thw=torch.as_tensor(vp.image_grid_thw),
            attention_mask=torch.ones(1, len(vp.input_ids), dtype=torch.long),
            do_sample=True,
            temperature=0.7,
            top_k=0,
            # as generators do for this task (sample_special_tokens False): never an image pad
            bad_words_ids=[[i] for i in prompter.tokenizer.all_special_ids if i != prompter.tokenizer.eos_token_id],
            max_new_tokens=6,
            min_new_tokens=6,
            output_logits=True,
            return_dict_in_generate=True,
        )
        response = gen.sequences[0, len(vp.input_ids) :]
        decoded = torch.stack(
            [torch.log_softmax(g[0].float() / 0.7, -1)[t] for g, t in zip(gen.logits, response, strict=True)]
        )
        one_pass = response_logprobs(model, vp, response.numpy(), temperature=0.7)
    torch.testing.assert_close(one_pass, decoded, atol=1e-5, rtol=0)


def test_encode_refuses_an_image_past_the_limits():
    from PIL import Image

    with pytest.raises(ImageTooLarge, match="max_pixels 100"):
        encode_image(Image.new("RGB", (11, 10)), ImageLimits(max_pixels=100))
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    with pytest.raises(ImageTooLarge, match="max_bytes 1000"):
        encode_image(noisy, ImageLimits(max_bytes=1000))


def _png_header_only(width: int, height: int, depth: int = 8) -> bytes:
    """A PNG whose header claims width x height (a decompression bomb's shape), with no pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, depth, 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("not bytes", "expected PNG bytes"),
        (b"GIF89a....", "not a PNG"),
        (b"x" * 2000, "max_bytes"),
        (_png_header_only(2000, 2000), "max_pixels"),
        (PNG_SIGNATURE + b"garbage", "without an IHDR"),
        (_png_header_only(16, 16), "does not decode"),  # no pixel data
        (_png_header_only(0, 16), "0x16 has no pixels"),
        (_png_header_only(2**32 - 1, 2**32 - 1), "max_pixels"),
        (_png_header_only(16, 16, depth=3), "PNG header 16x16 does not parse"),
    ],
    ids=["str", "gif", "past-max-bytes", "bomb-header", "no-ihdr", "no-pixel-data", "zero-width", "2^64-px", "depth-3"],
)
def test_untrusted_image_bytes_are_a_record_error_not_a_crash(value, why):
    limits = ImageLimits(max_bytes=1500)
    with pytest.raises(RecordError, match=why) as e:
        decode_image(value, limits)
    assert e.value.reason == "bad_image"
    assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)  # says what, not PIL's buffer object


def test_group_image_checks_name_the_bad_one():
    from PIL import Image

    limits = ImageLimits(max_images=2)
    good = encode_image(Image.new("RGB", (28, 28)), limits)
    assert len(check_group_images({IMAGES_KEY: [good, good]}, limits)) == 2
    assert check_group_images({}, limits) == []
    for meta, why in [
        ({IMAGES_KEY: [good] * 3}, "3 images > rollout.images.max_images 2"),
        ({IMAGES_KEY: good}, "expected a list"),
        ({IMAGES_KEY: [good, b"nope"]}, r"images\[1\]: not a PNG"),
    ]:
        with pytest.raises(RecordError, match=why):
            check_group_images(meta, limits)


def test_intake_dead_letters_a_group_with_a_bad_image_and_hands_out_the_good_one():
    """Images read back from the queue are checked where they are read: a forged one is
    dead-lettered with its reason, the consumer goes on."""
    from asyncrl.data.codec import encode_group
    from asyncrl.data.contract import RecordContract
    from asyncrl.queue import keys
    from asyncrl.queue.intake import sort_entries
    from asyncrl.types import RolloutGroup, Sample

    limits = ImageLimits()
    contract = RecordContract(vocab_size=16, max_len=12, group_size=2, stepwise=False, max_version=5, images=limits)
    _, meta = ColourEnv().make_prompt(random.Random(0))

    def group(gid: str, images) -> bytes:
        samples = [Sample([3] * 4, [-0.5] * 4, [1] * 4, 1.0, 3, generator_id="gen-0") for _ in range(2)]
        return encode_group(RolloutGroup(gid, gid, [1, 2, 3], samples, env="colour", metadata={IMAGES_KEY: images}))

    entries = [
        ("1-1", {keys.RECORD_FIELD: group("good", meta[IMAGES_KEY])}),
        ("1-2", {keys.RECORD_FIELD: group("bomb", [_png_header_only(4000, 4000)])}),
        ("1-3", {keys.RECORD_FIELD: group("not-png", [b"\x00" * 10])}),
    ]
    intake = sort_entries(entries, 0, set(), 1 << 20, 0, contract=contract)
    assert [g.group_id for _, g in intake.out] == ["good"]
    assert [(d["group_id"], d["reason"]) for d in intake.dead] == [("bomb", "bad_image"), ("not-png", "bad_image")]
    assert "max_pixels" in str(intake.dead[0]["detail"])
    # a text run's generators refuse prompt images: a group that has some was sampled elsewhere and
    # would train on its text alone, so it is dead-lettered; a text group (no images, or none listed) is not
    text = RecordContract(vocab_size=16, max_len=12, group_size=2, stepwise=False, max_version=5)
    entries += [("1-4", {keys.RECORD_FIELD: group("none", [])})]
    intake = sort_entries(entries, 0, set(), 1 << 20, 0, contract=text)
    assert [g.group_id for _, g in intake.out] == ["none"]
    assert {d["reason"] for d in intake.dead} == {"bad_image"} and len(intake.dead) == 3
    assert "text model" in str(intake.dead[0]["detail"])


def test_check_reads_and_decodes_a_drawn_prompts_images():
    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.preflight import check_imports
    from asyncrl.rollout.vision_prompts import describe_images

    cfg = load_config(None, ["rollout.env=asyncrl.rollout.envs.colour:ColourEnv", "rollout.env_kwargs={}"])
    # --check does not let a user believe a text model sees the images: a generator would refuse them
    with pytest.raises(ConfigError, match=r"1 prompt image\(s\), but rollout.model=tiny is a text model"):
        check_imports(cfg)
    assert (
        describe_images("tiny", False, "abc", {"target": "abc"}, "copy", ImageLimits()) == []
    )  # a text task: no image line
    with pytest.raises(ConfigError, match=r"images: bad_image: images\[0\]: not a PNG"):
        describe_images("tiny", False, "x", {IMAGES_KEY: [b"BM not a png"]}, "mine", ImageLimits())


class NoMetadataEnv(ColourEnv):
    """make_prompt gives no metadata dict: every generator would die at its metadata.get."""

    def make_prompt(self, rng):
        return "colour?", None


class Base64ImageEnv(ColourEnv):
    """An image as a base64 string (as JSON carries it), not PNG bytes."""

    def make_prompt(self, rng):
        return "colour?", {"target": "red", IMAGES_KEY: ["iVBORw0KGgo="]}


def test_check_refuses_a_drawn_prompt_it_cannot_read_with_the_reason():
    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.preflight import check_imports

    def check(env: str) -> list[str]:
        return check_imports(load_config(None, [f"rollout.env=tests.unit.test_vision:{env}", "rollout.env_kwargs={}"]))

    with pytest.raises(ConfigError, match=r"NoMetadataEnv'?: make_prompt returned \(str, NoneType\), expected"):
        check("NoMetadataEnv")
    with pytest.raises(ConfigError, match=r"images\[0\] is str, expected PNG bytes"):
        check("Base64ImageEnv")


def test_a_vision_language_model_is_refused_with_the_reason(tiny_vl):
    """No generator hands images to the engine yet: a run would train the model on text alone."""
    from asyncrl.rollout import families

    with pytest.raises(families.ModelRefused, match=r"model_type qwen2_vl\): a vision-language model.*torchvision"):
        families.check_model(str(tiny_vl))


def test_the_learner_loss_reaches_the_vision_tower(prompter, model):
    """Training on a response's log-probs moves the image encoder too, not the text model alone."""
    from asyncrl.learner.vision import response_logprobs

    _, meta = ColourEnv().make_prompt(random.Random(1))
    vp = prompter.encode(_messages(), check_group_images(meta, ImageLimits()))
    model.zero_grad()
    response_logprobs(
        model, vp, np.array([prompter.tokenizer.convert_tokens_to_ids(c) for c in "red"])
    ).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(".visual." in n or n.startswith("visual.") for n in grads if grads[n].abs().sum() > 0), list(grads)[:5]
    model.zero_grad()
    with pytest.raises(ValueError, match="image-pad token"):
        response_logprobs(model, vp, np.array([prompter.image_pad_id]))


def test_any_model_with_a_vision_tower_is_refused_not_only_qwen2_vl():
    """Qwen3-VL, LLaVA, a multimodal Gemma 3: no generator hands them images either."""
    from asyncrl.rollout import families

    for model_type in ("qwen3_vl", "llava", "gemma3"):
        config = {"model_type": model_type, "vision_config": {"hidden_size": 64}, "text_config": {}}
        with pytest.raises(families.ModelRefused, match=rf"model_type {model_type}\): a vision-language model"):
            families.check_config("m", config)
    # the text model of the same family is not
    assert families.check_config("m", {"model_type": "gemma3_text"}).name == "Gemma 3 (text)"


def _png_with_chunk_after_pixels(kind: bytes, body: bytes) -> bytes:
    """An 8x8 RGB PNG, CRCs right, with one more chunk between its pixels and IEND: PIL parses
    such a chunk in load(), with its own parser (an empty iCCP: IndexError, not OSError)."""

    def chunk(k: bytes, b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + k + b + struct.pack(">I", zlib.crc32(k + b))

    ihdr = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + b"\x10\x20\x30" * 8 for _ in range(8)))
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(kind, body) + chunk(b"IEND", b"")


def test_a_png_whose_ancillary_chunk_breaks_pils_parser_is_not_a_consumer_crash():
    """PIL's chunk parsers raise what they raise (an empty iCCP after the pixels: IndexError, which
    once ended the trainer's intake). Such a chunk never reaches PIL now (only the chunks pixels
    come from do), and any other decoding failure is the record's bad_image: the intake goes on."""
    from asyncrl.data.codec import encode_group
    from asyncrl.data.contract import RecordContract
    from asyncrl.queue import keys
    from asyncrl.queue.intake import sort_entries
    from asyncrl.types import RolloutGroup, Sample

    forged = _png_with_chunk_after_pixels(b"iCCP", b"")
    assert decode_image(forged, ImageLimits()).getpixel((3, 3)) == (16, 32, 48)
    limits = ImageLimits()
    contract = RecordContract(vocab_size=16, max_len=12, group_size=1, stepwise=False, max_version=5, images=limits)
    _, meta = ColourEnv().make_prompt(random.Random(0))

    def group(gid: str, images) -> bytes:
        samples = [Sample([3] * 4, [-0.5] * 4, [1] * 4, 1.0, 3, generator_id="gen-0")]
        return encode_group(RolloutGroup(gid, gid, [1, 2, 3], samples, env="colour", metadata={IMAGES_KEY: images}))

    plain = _png_with_chunk_after_pixels(b"tEXt", b"k\x00v")
    start = plain.index(b"IDAT") - 4
    broken = plain[:start] + b"\x00\x00\x00\x08IDATnot zlib" + struct.pack(">I", zlib.crc32(b"IDATnot zlib"))
    broken += plain[plain.index(b"tEXt") - 4 :]  # its pixels' chunk is not a zlib stream
    entries = [
        ("1-1", {keys.RECORD_FIELD: group("forged", [forged])}),
        ("1-2", {keys.RECORD_FIELD: group("broken", [broken])}),
        ("1-3", {keys.RECORD_FIELD: group("good", meta[IMAGES_KEY])}),
    ]
    intake = sort_entries(entries, 0, set(), 1 << 20, 0, contract=contract)
    assert [g.group_id for _, g in intake.out] == ["forged", "good"]
    assert [(d["group_id"], d["reason"]) for d in intake.dead] == [("broken", "bad_image")]


def test_text_and_icc_chunks_are_never_inflated():
    """A few KiB of zTXt / iTXt / iCCP chunks inflate to up to 64 MiB of text an image, in PIL,
    before any pixel (and again for every reader of the record: intake, the learner's driver, a
    generator): they are left out before PIL sees the bytes, so none of it is inflated or kept."""
    text = zlib.compress(b"a" * (1 << 20), 9)  # 1 MiB from about 1 KiB
    chunks = [
        (b"zTXt", b"k%d\x00\x00" % k + text) if k % 2 else (b"iTXt", b"k%d\x00\x01\x00\x00\x00" % k + text)
        for k in range(70)  # 70 MiB of text: past PIL's own 64 MiB cap, which refused the image
    ]

    def chunk(k: bytes, b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + k + b + struct.pack(">I", zlib.crc32(k + b))

    plain = _png_with_chunk_after_pixels(b"tIME", b"\x07\xea\x0b\x1d\x08\x00\x00")
    ihdr_end = len(PNG_SIGNATURE) + 25
    bomb = (
        plain[:ihdr_end] + chunk(b"iCCP", b"p\x00\x00" + text) + b"".join(chunk(*c) for c in chunks) + plain[ihdr_end:]
    )
    assert len(bomb) < ImageLimits().max_bytes
    image = decode_image(bomb, ImageLimits())
    assert image.size == (8, 8) and image.getpixel((0, 0)) == (16, 32, 48)
    assert not any(isinstance(v, (str, bytes)) and len(v) > 1000 for v in image.info.values()), list(image.info)
    with pytest.raises(RecordError, match="truncated"):
        decode_image(bomb[:-20], ImageLimits())
