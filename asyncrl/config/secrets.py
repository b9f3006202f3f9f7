"""The copy of a config that may leave the run's 0600 config.yaml, and its way back.

    redact_config(cfg)            # cfg.to_dict() with every secret replaced: Redis, the dashboard, wandb, logs
    rejoin_config(published, redis_url=url, password=pw)   # a joining generator's own secrets put back

Which fields are secret is said by the fields themselves (``Annotated[..., SECRET]`` or
``CREDENTIALS_URL``, asyncrl.config.base), so a secret added to the tree is redacted
everywhere without touching this module. Free-form mappings (``rollout.env_kwargs``,
``rollout.engine_kwargs``) are published as they are: the generators that join a job need
them, so credentials for user code belong in environment variables, not there.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel

from asyncrl.config.base import Secret
from asyncrl.config.tree import Config
from asyncrl.infra import redact_url

REDACTED = "<redacted>"
"""What a secret value reads as outside config.yaml."""


@functools.cache
def secret_fields() -> dict[tuple[str, ...], Secret]:
    """Every marked field of the tree by its path, e.g. ("queue", "password")."""
    found: dict[tuple[str, ...], Secret] = {}

    def walk(model: type[BaseModel], prefix: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            path = (*prefix, name)
            mark = next((m for m in field.metadata if isinstance(m, Secret)), None)
            if mark is not None:
                found[path] = mark
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, path)

    walk(Config, ())
    return found


def redact_config(config: Config | Mapping[str, Any]) -> dict[str, Any]:
    """A plain copy of `config` (a Config, or its dict as config.yaml or Redis hold it) with
    each secret value replaced by REDACTED and each credentials URL shown without its
    password (asyncrl.infra.redact_url). Unset (None) values stay None; keys the tree does
    not know are kept as they are."""
    data = config.to_dict() if isinstance(config, Config) else copy.deepcopy(dict(config))
    for path, mark in secret_fields().items():
        node: Any = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(path[-1]) is None:
            continue
        value = node[path[-1]]
        node[path[-1]] = redact_url(value) if mark.url and isinstance(value, str) else REDACTED
    return data


def rejoin_config(published: Mapping[str, Any], *, redis_url: str, password: str | None) -> dict[str, Any]:
    """A job's published (redacted) config made usable by a process that joins the job
    (`asyncrl generate`): the Redis URL and password it connected with stand in for the job's,
    and it serves no dashboard, so it holds no dashboard token. A password given only inside
    `redis_url` (user info or ``?password=``) is taken from there."""
    data = copy.deepcopy(dict(published))
    if password is None:
        parts = urlsplit(redis_url)
        in_query = dict(parse_qsl(parts.query)).get("password")
        password = unquote(parts.password) if parts.password else in_query
    queue = data.setdefault("queue", {})
    if isinstance(queue, dict):
        queue.update(redis_url=redis_url, password=password)
    control = data.get("control")
    if isinstance(control, dict):
        control.pop("storage_options", None)  # redacted, and a generator writes no run dir
    monitor = data.setdefault("monitor", {})
    if isinstance(monitor, dict):
        for name in ("dashboard", "dashboard_host", "dashboard_token"):
            monitor.pop(name, None)  # the defaults: off, loopback, no token
        monitor["dashboard"] = False
    return data
