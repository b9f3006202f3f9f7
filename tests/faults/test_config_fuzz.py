"""Fuzz the config loader: any tree, any override, any type -> a valid Config or a
ConfigError that names the offending field; never a traceback from deep inside."""

from __future__ import annotations

import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.config import Config, ConfigError, config_from_dict, load_config
from asyncrl.config.losses import LOSS_FIELDS, POLICY_LOSSES

SECTIONS = list(Config.model_fields)
FIELDS = {name: list(f.annotation.model_fields) for name, f in Config.model_fields.items()}
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
)
# Mostly real section/field names, so the fuzz reaches the type checks and cross-field rules.
keys = st.one_of(st.sampled_from(sorted({k for v in FIELDS.values() for k in v})), st.text(max_size=8))
sections = st.dictionaries(keys, st.one_of(scalars, st.dictionaries(keys, scalars, max_size=3)), max_size=5)
trees = st.one_of(
    st.dictionaries(st.sampled_from(SECTIONS), sections, max_size=4),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
    scalars,
)
# algo.policy_loss trees: a loss name and any loss's knobs (often another loss's: an error to name).
losses = st.dictionaries(
    st.sampled_from(["type", *LOSS_FIELDS, "kwargs"]),
    st.one_of(st.sampled_from(POLICY_LOSSES), scalars),
    max_size=3,
)


def _names_a_field(message: str) -> bool:
    # "algo.policy_loss=...", "control.max_staleness must ...", "foo: unknown field", "config root: ..."
    # an unknown key is named as the user wrote it, whatever its characters ("A·: unknown field")
    return bool(re.match(r"^[\w\[\]\.]+(=|:| must| is|\[)|^config |^override |^\S+: unknown field", message)) or any(
        f"{s}." in message for s in SECTIONS
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_random_trees_give_valid_config_or_named_error(tree):
    try:
        cfg = config_from_dict(tree)
    except ConfigError as e:
        assert _names_a_field(str(e)), f"error does not name a field: {e}"
    else:
        assert isinstance(cfg, Config)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(s, f) for s, fs in FIELDS.items() for f in fs]), scalars)
def test_every_field_with_random_values(path, value):
    section, name = path
    try:
        config_from_dict({section: {name: value}})
    except ConfigError as e:
        assert f"{section}.{name}" in str(e) or _names_a_field(str(e)), str(e)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_random_override_strings(text):
    try:
        load_config(None, [text])
    except ConfigError as e:
        assert _names_a_field(str(e)) or "override" in str(e), str(e)


@settings(max_examples=200, deadline=None)
@given(st.one_of(losses, st.sampled_from(POLICY_LOSSES), scalars))
def test_random_policy_loss_sections(loss):
    try:
        cfg = config_from_dict({"algo": {"policy_loss": loss, "loss_reduction": "sequence_mean"}})
    except ConfigError as e:
        assert "algo.policy_loss" in str(e), str(e)
    else:
        assert cfg.algo.policy_loss.type in POLICY_LOSSES


def test_yaml_file_that_is_not_a_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump([1, 2, 3]))
    try:
        load_config(p)
    except ConfigError as e:
        assert "expected a mapping" in str(e)
    else:
        raise AssertionError("a list at the top level was accepted")
