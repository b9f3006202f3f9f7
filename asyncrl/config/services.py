"""The queue and monitor sections: the run's Redis and its dashboard, the two services others
can reach over the network, with the rules that keep them from being reached unguarded."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import CREDENTIALS_URL, SECRET, ConfigError, Section
from asyncrl.infra import redact_url


def loopback_only(bind: str) -> bool:
    """Whether a Redis ``bind`` line (addresses separated by spaces, each maybe prefixed "-")
    names only loopback addresses. A wildcard, a host name or anything unparsable is not."""
    addresses = [a.removeprefix("-") for a in bind.split()]
    if not addresses:
        return False
    for a in addresses:
        if a == "localhost":
            continue
        try:
            if not ipaddress.ip_address(a).is_loopback:
                return False
        except ValueError:
            return False
    return True


MIN_DASHBOARD_TOKEN = 16


class QueueConfig(Section):
    """The Redis replay queue; embedded redis-server unless a URL is given."""

    redis_url: Annotated[str | None, CREDENTIALS_URL] = None
    """redis://, rediss:// or unix:// URL; None starts an embedded redis-server on 127.0.0.1."""
    password: Annotated[str | None, SECRET] = None
    """A secret: only the run's config.yaml (0600) holds it; Redis, the dashboard, wandb and
    logs get "<redacted>" (asyncrl.config.secrets). So does a password inside redis_url."""
    maxlen: int = Field(4096, ge=1)
    """Bound on queued groups; put() waits (backpressure) rather than dropping fresh data."""
    put_timeout_s: float = Field(60.0, gt=0)
    """How long one put() waits on a full queue before raising QueueFull; a generator then
    logs a warning and keeps waiting with its finished group (it never drops one)."""
    aof: bool = True
    """Embedded server: append-only persistence so un-acked records survive a restart."""
    max_record_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    bind: str = "127.0.0.1"
    ledger: bool = False
    """Record every produced group id in Redis (asyncrl:{run}:produced) so a run can be
    audited: produced = trained + dropped-stale + dead-lettered + still queued."""
    stale_reissues: int = Field(2, ge=0)
    """How many times a prompt whose group was dropped as too stale is run again (under a new
    id; 0: never). Stale groups are mostly the slow ones, so dropping them for good would
    bias training against long answers and hard prompts."""
    claim_idle_s: float = Field(900.0, gt=0)
    """Another consumer's un-acked entry idle this long is presumed orphaned and claimed;
    keep it above the time between checkpoints (entries stay un-acked until then)."""
    retry_deadline_s: float = Field(30.0, gt=0)
    """How long every Redis call retries (with backoff, a warning per retry) through an outage:
    a server restart or network blip shorter than this is ridden out quietly. A longer outage
    pauses the job (trainer and generators wait, one line a minute) until outage_deadline_s."""
    outage_deadline_s: float | None = Field(None, gt=0)
    """None: wait out any Redis outage. A number (>= retry_deadline_s): after that many seconds
    unreachable the trainer checkpoints, prints the resume command and fails (QueueUnavailable)."""

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"queue.redis_url={redact_url(value)!r}: must start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _exposed_redis(self) -> QueueConfig:
        # redis-server turns protected mode off under an explicit bind: without a password,
        # anyone who reaches the port can write the queue and files as this user.
        if self.redis_url is None and not loopback_only(self.bind) and not self.password:
            raise ConfigError(
                f"queue.bind={self.bind!r}: binding beyond loopback requires queue.password "
                "(or keep queue.bind=127.0.0.1)"
            )
        return self

    @model_validator(mode="after")
    def _deadlines(self) -> QueueConfig:
        if self.outage_deadline_s is not None and not self.outage_deadline_s >= self.retry_deadline_s:
            raise ConfigError(
                f"queue.outage_deadline_s={self.outage_deadline_s!r}: must be >= queue.retry_deadline_s="
                f"{self.retry_deadline_s:g} (an outage is retried that long first), or null (the default) to wait "
                "out any outage"
            )
        return self


class MonitorConfig(Section):
    """Metrics sinks and the thresholds the dashboard alerts on."""

    wandb: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "asyncrl"
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars under run_dir/tensorboard."""
    console: bool = True
    console_every: int = Field(10, ge=1)
    """Print a metrics line every this many steps (the progress bar updates every step)."""
    verbose: bool = False
    """Stream every Ray worker's output (vLLM engines included) to the console, as Ray does by
    default. Off: it stays in Ray's worker logs, linked from run_dir/logs/ray, and the console
    shows asyncrl's own lines (`asyncrl train --verbose` turns it on)."""
    dashboard: bool = True
    """`asyncrl train` serves the dashboard itself on dashboard_host:dashboard_port. A
    dashboard_token is at least 16 characters, or "generate": a random one, written to
    run_dir/dashboard_token (0600); every request then needs it (?token=, a bearer header,
    or the cookie the first visit sets)."""
    dashboard_port: int = 8470
    dashboard_host: str = "127.0.0.1"
    """Beyond loopback it needs dashboard_token."""
    dashboard_token: Annotated[str | None, SECRET] = None
    """A secret, kept like queue.password."""
    alert_rollout_kl: float = 0.05
    alert_masked_frac: float = 0.2
    alert_staleness_frac: float = 1.0
    """Alert when a step's mean staleness reaches this fraction of max_staleness (the mean: an
    async run trains some groups at the bound as a matter of course)."""
    alert_reward_failure_rate: float = Field(0.5, gt=0, le=1)
    """Alert (console and dashboard, naming the reward) when more than this share of a
    generator's latest reward scorings failed (rollout/scoring.py: raised, timed out or not a
    number; rollout.reward_on_failure stand-ins included): a verifier or reward model that is
    down looks, without it, like a task whose every group ties."""
    alert_logprob_diff_max: float = Field(0.5, gt=0)
    """Alert when drift/logprob_abs_diff_max (max over a step's loss tokens of |learner old
    logprob - engine logprob|, nats) exceeds this on a step that trained only fresh data
    (staleness/max = 0, as every sync-mode step): the learner then holds the very weights that
    sampled, so the gap is float noise (~1e-6 in float32, ~0.1 in bf16) unless a sampling
    setting, a token mask or the weights differ. 0.5 nats is a factor of 1.65 in probability.
    Steps with stale tokens are not judged: the policy's own updates move single tokens by
    several nats there (the demo at lr 1e-3, staleness <= 2: median 0.27, max 3.3)."""

    @model_validator(mode="after")
    def _exposed_dashboard(self) -> MonitorConfig:
        if self.dashboard_host not in ("127.0.0.1", "localhost", "::1") and not self.dashboard_token:
            raise ConfigError(
                f"monitor.dashboard_host={self.dashboard_host!r}: binding beyond loopback requires "
                f"monitor.dashboard_token"
            )
        token = self.dashboard_token
        if token is not None and token != "generate" and len(token) < MIN_DASHBOARD_TOKEN:
            raise ConfigError(
                f"monitor.dashboard_token: {len(token)} characters; give at least {MIN_DASHBOARD_TOKEN}, "
                "or 'generate' for a random one written to the run directory"
            )
        return self
