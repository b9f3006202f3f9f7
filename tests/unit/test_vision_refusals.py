"""Records with images that the learner must not train on are refused with their reason, never
a crash: images that do not decode (garbage, truncated, not a PNG), prompts whose image tokens
do not match their images, a sampled image token; past the batch builder, the driver's check
and the forward refuse a mismatch before any collective. A group's samples share one tile
array through pickling (what lets a micro-batch encode their image once). Also refused: a
critic, and a model whose pad token is its image token.

    .venv/bin/python -m pytest tests/unit/test_vision_refusals.py -q    # about 20 s
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from asyncrl.config import AlgoConfig  # noqa: E402
from asyncrl.data import microbatch as mbatch  # noqa: E402
from asyncrl.data.codec import RecordError  # noqa: E402
from asyncrl.data.images import IMAGES_KEY  # noqa: E402
from asyncrl.data.pixels import IMAGE_TOKENS, ImagePixels  # noqa: E402
from tests.support.vision_records import engine_prompt, group, load_plain, micro, sequences  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_idefics3) -> str:
    return str(tiny_idefics3)


@pytest.fixture(scope="module")
def pixels(model_dir):
    return ImagePixels.of(model_dir)


def test_a_groups_samples_share_one_tile_after_pickling(model_dir, pixels):
    """A rank's plan arrives pickled (Ray: protocol 5, arrays out of band); the samples of a
    group still hold one array, so the micro-batch encodes their image once."""
    import pickle

    seqs, _ = sequences(model_dir, pixels, [group(model_dir, "g", ["red", "blue"], np.random.default_rng(9), n=3)])
    buffers: list = []
    data = pickle.dumps([mbatch.seq_fields(s) for s in seqs], protocol=5, buffer_callback=buffers.append)
    mb = mbatch.collate(pickle.loads(data, buffers=buffers), pad_token_id=0)
    assert mb[mbatch.PIXEL_VALUES].shape[1] == 2 and mb[mbatch.TILE_INDEX].tolist() == [0, 1] * 3


def test_records_whose_images_do_not_fit_are_refused_with_the_reason(model_dir, pixels):
    rng = np.random.default_rng(1)
    one = engine_prompt(model_dir, 1)
    short = one[one != pixels.image_token_id]  # the image's tokens lost
    cut = np.delete(one, np.flatnonzero(one == pixels.image_token_id)[0])  # one token short
    cases = {
        "two images, one image's tokens": group(model_dir, "a", ["red", "blue"], rng, prompt=one),
        "no image tokens": group(model_dir, "b", ["red"], rng, prompt=short),
        "a short run": group(model_dir, "c", ["red"], rng, prompt=cut),
    }
    for what, g in cases.items():
        got = pixels.encode(g.metadata)
        with pytest.raises(RecordError) as e:
            pixels.check_tokens(g.prompt_ids, got)
        assert e.value.reason == IMAGE_TOKENS and "image tile(s) need" in e.value.detail, what

    good = group(model_dir, "ok", ["green"], rng)
    seqs, metrics = sequences(model_dir, pixels, [*cases.values(), good])
    assert metrics["vision/refused_samples"] == 6
    for s in seqs[:6]:  # no loss, no image token left for a forward to look for
        assert not s.loss_mask.any() and not (s.input_ids == pixels.image_token_id).any()
        assert len(s.pixel_values) == 0
    assert seqs[6].loss_mask.any() and len(seqs[6].pixel_values) == 1


def test_a_sampled_image_token_is_refused_with_the_reason(model_dir, pixels, caplog):
    """A run whose engines may sample special tokens can sample the image token; the model
    would look for features no image backs. That sample is refused, its group's others train."""
    from asyncrl.learner.validate import validate_minibatches

    g = group(model_dir, "s", ["red"], np.random.default_rng(8))
    g.samples[1].response_ids[1] = pixels.image_token_id
    with caplog.at_level("WARNING"):
        seqs, metrics = sequences(model_dir, pixels, [g])
    assert metrics["vision/refused_samples"] == 1
    assert "image_tokens: the response holds 1 image token(s)" in caplog.text
    assert seqs[0].loss_mask.any() and len(seqs[0].pixel_values) == 1
    assert not seqs[1].loss_mask.any() and not (seqs[1].input_ids == pixels.image_token_id).any()
    validate_minibatches([seqs], AlgoConfig(), max_positions=512, vocab_size=None, pixels=pixels)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"GIF89a not a png", "not a PNG"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "IHDR"),
        ("a string", "expected PNG bytes"),
    ],
)
def test_garbage_image_bytes_are_refused(model_dir, pixels, data, says):
    g = group(model_dir, "bad", ["red"], np.random.default_rng(2))
    g.metadata[IMAGES_KEY] = [data]
    with pytest.raises(RecordError) as e:
        pixels.encode(g.metadata)
    assert e.value.reason == "bad_image" and says in str(e.value)
    seqs, metrics = sequences(model_dir, pixels, [g])
    assert metrics["vision/refused_samples"] == 2 and not any(s.loss_mask.any() for s in seqs)


def test_a_truncated_png_is_refused(model_dir, pixels):
    g = group(model_dir, "cut", ["red"], np.random.default_rng(3))
    g.metadata[IMAGES_KEY] = [g.metadata[IMAGES_KEY][0][:60]]
    with pytest.raises(RecordError, match="bad_image"):
        pixels.encode(g.metadata)


def test_the_driver_and_the_forward_refuse_images_that_do_not_match_their_tokens(model_dir, pixels):
    """Past the batch builder, a mismatch is a bug: the driver's check names the sequence
    before any rank sees it, and the forward refuses before its first collective."""
    from asyncrl.learner.validate import validate_minibatches
    from asyncrl.learner.vision import image_inputs

    seqs, _ = sequences(model_dir, pixels, [group(model_dir, "g", ["red"], np.random.default_rng(4))])
    bad = seqs[0]
    bad.pixel_values = np.concatenate([bad.pixel_values] * 2)
    bad.pixel_attention_mask = np.concatenate([bad.pixel_attention_mask] * 2)
    with pytest.raises(ValueError, match="4 image tokens for 2 tiles x 4"):
        validate_minibatches([seqs], AlgoConfig(), max_positions=512, vocab_size=None, pixels=pixels)
    with pytest.raises(ValueError, match="carries images, and the model has no vision tower"):
        validate_minibatches([seqs], AlgoConfig(), max_positions=512, vocab_size=None, pixels=None)

    hf = load_plain(model_dir)
    with pytest.raises(ValueError, match="2 tiles x 4 holds 4 image tokens"):
        image_inputs(hf, micro([bad], False), torch.device("cpu"))
    no_images = {k: v for k, v in micro([bad], False).items() if k not in mbatch.IMAGE_FIELDS}
    with pytest.raises(ValueError, match="4 image tokens and no images"):
        image_inputs(hf, no_images, torch.device("cpu"))


def test_a_model_whose_pad_token_is_its_image_token_is_refused(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.pad_token_id = config.image_token_id
    with pytest.raises(ValueError, match="pad_token_id is the image token"):
        ImagePixels.of(model_dir, config=config)


def test_a_vision_config_without_its_own_pad_id_pads_inside_the_vocabulary(model_dir):
    """An Idefics3 config.json with no top-level pad_token_id reads as the class default 128002,
    past the tiny vocabulary (and SmolVLM's): the learner (driver and ranks) pads with the text
    config's id instead, so an embedding lookup of a padded micro-batch, or of a refused prompt
    whose image tokens became the pad id, stays in range."""
    import json
    import shutil

    from transformers import AutoConfig

    from asyncrl.data.microbatch import model_pad_token_id

    bare = model_dir + "-no-pad"
    shutil.copytree(model_dir, bare, dirs_exist_ok=True)
    data = json.loads((Path(bare) / "config.json").read_text())
    data.pop("pad_token_id")
    (Path(bare) / "config.json").write_text(json.dumps(data))
    config = AutoConfig.from_pretrained(bare)
    text = config.get_text_config()
    assert config.pad_token_id >= text.vocab_size  # what the old `config.pad_token_id` padded with
    assert model_pad_token_id(config) == text.pad_token_id < text.vocab_size
    assert ImagePixels.of(bare, config=config) is not None
    assert model_pad_token_id(AutoConfig.from_pretrained(model_dir)) == text.pad_token_id  # its own, in range
    text.pad_token_id = None
    assert model_pad_token_id(config) == 0


def test_vision_learner_limits_are_refused_from_the_config_before_anything_starts(model_dir):
    """Start-up and --check read config.json: context parallelism (refused otherwise only inside
    each rank, after Ray is up), LoRA and a separate critic are refused with one line each."""
    from asyncrl.rollout.families import ModelRefused, check_vision_learner, read_config

    config = read_config(model_dir)
    for kwargs, what in (
        ({"critic": True, "lora": False, "context_parallel": 1}, r"algo\.critic"),
        ({"critic": False, "lora": True, "context_parallel": 1}, r"learner\.lora"),
        ({"critic": False, "lora": False, "context_parallel": 2}, r"learner\.context_parallel=2"),
    ):
        with pytest.raises(ModelRefused, match=rf"is a vision-language model: not with {what}"):
            check_vision_learner(model_dir, config, **kwargs)
    check_vision_learner(model_dir, config, critic=False, lora=False, context_parallel=1)
    text = {k: v for k, v in config.items() if k != "vision_config"}
    check_vision_learner("text", text, critic=True, lora=True, context_parallel=2)  # checked elsewhere
    check_vision_learner("hub/id", None, critic=True, lora=True, context_parallel=2)  # not read: the loaders check


def test_a_critic_or_lora_is_refused_for_a_vision_model_before_ray(model_dir):
    from asyncrl.config import Config
    from asyncrl.config.training import LoraConfig
    from asyncrl.learner import LearnerGroup

    cfg = Config()
    cfg.algo = AlgoConfig(advantage_estimator="gae", critic={"enabled": True})
    with pytest.raises(ValueError, match=r"algo\.critic: not for a vision-language model"):
        LearnerGroup(cfg, model_dir, num_ranks=1, sample_special_tokens=False)
    cfg = Config()
    cfg.learner.lora = LoraConfig()
    with pytest.raises(ValueError, match=r"learner\.lora: not for a vision-language model"):
        LearnerGroup(cfg, model_dir, num_ranks=1, sample_special_tokens=False)
