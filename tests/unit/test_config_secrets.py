"""The config's secrets and their redacted copy (asyncrl.config.secrets): what leaves config.yaml
has no secret in it, and a generator joining the job can make it whole with its own password."""

from __future__ import annotations

import pytest

from asyncrl.config import REDACTED, ConfigError, config_from_dict, load_config, redact_config, rejoin_config

SECRETS = ("s3cret-pw", "s3cret-in-url", "s3cret-ray", "s3cret-token-0123456789")


def test_every_secret_is_redacted_and_everything_else_kept():
    cfg = load_config(
        None,
        [
            f"queue.password={SECRETS[0]}",
            f"queue.redis_url=redis://alice:{SECRETS[1]}@10.0.0.5:6380/2",
            f"control.ray_address=ray://:{SECRETS[2]}@head:10001",
            f"monitor.dashboard_token={SECRETS[3]}",
            "control.run_name=kept",
        ],
    )
    published = redact_config(cfg)
    assert not any(s in repr(published) for s in SECRETS)
    assert published["queue"]["password"] == published["monitor"]["dashboard_token"] == REDACTED
    assert published["queue"]["redis_url"] == "redis://alice@10.0.0.5:6380/2"  # the address stays
    assert published["control"]["ray_address"] == "ray://head:10001"
    whole = cfg.to_dict()
    changed = {
        (name, key) for name, section in whole.items() for key in section if published[name][key] != section[key]
    }
    assert changed == {
        ("queue", "password"),
        ("queue", "redis_url"),
        ("control", "ray_address"),
        ("monitor", "dashboard_token"),
    }
    assert published["control"]["run_name"] == "kept"
    # Unset secrets stay unset, and a dict (config.yaml, Redis) is redacted like the tree.
    plain = redact_config(load_config(None, []))
    assert plain["queue"]["password"] is None and plain["monitor"]["dashboard_token"] is None
    assert redact_config(cfg.to_dict()) == published
    assert redact_config({"queue": "not a section", "extra": 1}) == {"queue": "not a section", "extra": 1}


@pytest.mark.parametrize(
    ("url", "password", "expected"),
    [
        ("redis://127.0.0.1:7000/0", "given", "given"),
        ("redis://:p%40ss@127.0.0.1:7000/0", None, "p@ss"),  # from the URL, unquoted
        ("unix:///run/redis.sock?db=0&password=q", None, "q"),
        ("redis://127.0.0.1:7000/0", None, None),
    ],
)
def test_a_joining_generator_brings_its_own_connection(url, password, expected):
    published = redact_config(
        load_config(None, [f"queue.password={SECRETS[0]}", f"monitor.dashboard_token={SECRETS[3]}"])
    )
    cfg = config_from_dict(rejoin_config(published, redis_url=url, password=password))
    assert cfg.queue.password == expected and cfg.queue.redis_url == url
    assert cfg.monitor.dashboard_token is None and not cfg.monitor.dashboard


def test_a_bad_redis_url_is_named_without_its_password():
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["queue.redis_url=http://:s3cret@cache:6379/0"])
    assert "s3cret" not in str(bad.value) and "cache:6379" in str(bad.value)


@pytest.mark.parametrize(
    ("field", "yaml_value", "shown_type"),
    [
        ("queue.password", "12:30:45", "int"),  # YAML 1.1 sexagesimal: 45045
        ("queue.password", "0x1F2E3D", "int"),
        ("queue.password", "1e999", "str"),  # stays text: accepted (checked below)
        ("queue.password", "yes", "bool"),
        ("monitor.dashboard_token", "2031-01-01", "date"),
        ("queue.redis_url", "[redis://:s3cret@h:1/0]", "list"),
        ("control.ray_address", "12345.678", "float"),
    ],
)
def test_a_secret_takes_only_a_string_and_is_never_shown_in_the_error(field, yaml_value, shown_type):
    """Unquoted in YAML, some passwords become numbers, dates or booleans: the section's
    number-to-text rule would take 45045 as the password. A secret refuses them, naming the
    field and the fix, and the error never shows the value."""
    import yaml

    section, name = field.split(".")
    data = yaml.safe_load(f"{section}:\n  {name}: {yaml_value}\n")
    if shown_type == "str":
        assert config_from_dict(data).queue.password == "1e999"
        return
    with pytest.raises(ConfigError) as bad:
        config_from_dict(data)
    message = str(bad.value)
    assert message.startswith(f"{field}: a secret must be a string, got a {shown_type}")
    assert "quote it" in message
    value = data[section][name]
    for shown in {yaml_value, str(value), repr(value), "45045", "s3cret"}:
        assert shown not in message


def test_no_type_error_about_a_secret_echoes_it():
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["control.storage_options=key-Sekr1t-value"])
    assert "Sekr1t" not in str(bad.value) and str(bad.value).startswith("control.storage_options: expected a mapping")


def test_repr_and_str_of_a_section_never_show_a_secret():
    cfg = load_config(None, ["queue.password=s3cretPW", "queue.redis_url=redis://:s3cretURL@h:6379/0"])
    for shown in (repr(cfg.queue), str(cfg.queue), repr(cfg)):
        assert "s3cret" not in shown and "<redacted>" in shown, shown
    assert "redis://h:6379/0" in repr(cfg.queue)  # a URL keeps what is not its credential
    assert cfg.queue.password == "s3cretPW"  # the value itself is untouched
