"""The tiny Idefics3 (SmolVLM's architecture) the vision-language tests and demo write: it loads in
transformers without torchvision, its processor expands ``<image>`` to the image's token count,
and its vision tower is wired in."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_idefics3(tmp_path_factory):
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    return write_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "model")


def _messages():
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


def test_the_written_directory_loads_and_expands_each_image_to_its_tokens(tiny_idefics3):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

    from asyncrl.rollout.tiny_vl import idefics3_image_seq_len

    processor = AutoProcessor.from_pretrained(str(tiny_idefics3))
    # the PIL image processor: the torchvision one cannot run on the CPU install
    assert type(AutoImageProcessor.from_pretrained(str(tiny_idefics3))).__name__ == "Idefics3ImageProcessorPil"
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_idefics3)).eval()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and model.dtype == torch.float32
    seq_len = idefics3_image_seq_len(64, 16, 2)
    assert seq_len == 4 == processor.image_seq_len

    text = processor.apply_chat_template([_messages()[0], _messages()[0]])
    assert text == "<image>colour?<image>colour?"
    images = [Image.new("RGB", (56, 56), (220, 30, 30)), Image.new("RGB", (30, 90), (30, 30, 220))]
    enc = processor(text=[text], images=[images], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    one = ["<fake_token_around_image>", "<global-img>", *["<image>"] * seq_len, "<fake_token_around_image>"]
    assert tokens == [*one, *"colour?", *one, *"colour?"]
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 2 * seq_len
    # every image, whatever its shape, becomes one 64x64 global image (no tiling)
    assert tuple(enc["pixel_values"].shape) == (1, 2, 3, 64, 64)

    with torch.no_grad():
        logits = [
            model(
                input_ids=enc["input_ids"][:, :11],
                pixel_values=enc["pixel_values"][:, i : i + 1],
                pixel_attention_mask=enc["pixel_attention_mask"][:, i : i + 1],
            ).logits[0, -1]
            for i in range(2)
        ]
    assert not torch.allclose(logits[0], logits[1])  # the image reaches the decoder


def test_a_shape_that_does_not_divide_is_refused(tmp_path):
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    with pytest.raises(ValueError, match="patch grid"):
        write_tiny_idefics3(tmp_path / "m", image_size=48, patch_size=16, scale_factor=2)
    assert not (tmp_path / "m").exists()
