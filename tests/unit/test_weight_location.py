"""A weight location's text form (what Redis stores) reads back as the same typed location, and
text that names the object store but no version is refused rather than taken for a file."""

from __future__ import annotations

import pytest

from asyncrl.types import WeightsFile, WeightsObject, format_location, parse_location


@pytest.mark.parametrize(
    "location",
    [
        WeightsFile("/dev/shm/asyncrl-demo-v3.safetensors"),
        WeightsFile("relative/v3.safetensors"),
        WeightsObject("demo", 3),
        WeightsObject("team/run-a", 120),  # a run name with a slash: the version is the last part
    ],
)
def test_the_text_form_reads_back_as_the_same_location(location):
    text = format_location(location)
    assert parse_location(text) == location
    assert str(location) == text  # what log lines and errors show is the stored form


def test_the_text_forms_are_a_path_and_a_ray_object_name():
    assert format_location(WeightsFile("/dev/shm/w.safetensors")) == "/dev/shm/w.safetensors"
    assert format_location(WeightsObject("demo", 3)) == "ray-object://demo/v3"


@pytest.mark.parametrize("text", ["ray-object://demo", "ray-object://demo/v", "ray-object:///v3", "ray-object://d/vx"])
def test_an_object_name_without_a_run_and_version_is_refused(text):
    with pytest.raises(ValueError, match="expected ray-object://RUN/vVERSION"):
        parse_location(text)
