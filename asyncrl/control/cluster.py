"""Joining Ray: a private local instance, or an existing (multi-node) cluster.

    connect_ray(cfg.control, env_vars={...})      # returns True if it started/attached Ray

No ``control.ray_address`` means a private instance on this machine (``address="local"``):
plain ``ray.init()`` would attach to whatever cluster Ray's ``ray_current_cluster`` file
names, even a stale one from an old ``ray start --head``, and then refuse the resource
arguments a private instance needs. A configured address (``HOST:PORT``, ``auto`` or a
``ray://`` client URL) attaches without resource arguments: the cluster's nodes declared
their own resources when they were started.

Attaching to a cluster that does not require Ray's token authentication logs one warning
(``warn_if_open_cluster``): anyone who reaches such a cluster's ports runs code as its user.
"""

from __future__ import annotations

import logging
import os
import socket

from asyncrl.config import ControlConfig
from asyncrl.infra import STARTING, Unreachable, actor_state, redact_url

log = logging.getLogger(__name__)


class ClusterUnavailable(RuntimeError, Unreachable):
    """control.ray_address names a Ray cluster that cannot be reached."""


def ray_init_kwargs(control: ControlConfig) -> dict:
    """The arguments ``ray.init`` gets for this config (env vars and logging aside)."""
    if control.ray_address is None:
        # Logical CPUs beyond the physical ones let learner ranks and generators co-exist on a
        # small machine; real placement is by affinity where benchmarks need it.
        return {
            "address": "local",
            "num_cpus": max(os.cpu_count() or 2, 8),
            "object_store_memory": control.ray_object_store_mb * 1024 * 1024,
        }
    return {"address": control.ray_address}


RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
"""What Ray logs on every private instance it starts with a token (our default): not news.
Its warning for a cluster without one is kept, and warn_if_open_cluster adds ours."""


class _DropRayTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RAY_TOKEN_NOTICE)


def mute_ray_token_notice() -> None:
    """Drop Ray's "token authentication is enabled" notice from this process's log (once)."""
    logger = logging.getLogger(RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropRayTokenNotice) for f in logger.filters):
        logger.addFilter(_DropRayTokenNotice())


def connect_ray(control: ControlConfig, env_vars: dict[str, str], *, verbose: bool = True) -> None:
    """``ray.init`` for this run; ClusterUnavailable (naming the address) if there is no cluster.
    Not `verbose`: workers' output stays in Ray's log files and Ray's own INFO lines are muted."""
    import ray

    mute_ray_token_notice()
    kwargs = ray_init_kwargs(control)
    if not verbose:
        kwargs["logging_level"] = logging.WARNING
    try:
        probe(control.ray_address)
        ray.init(include_dashboard=False, runtime_env={"env_vars": env_vars}, log_to_driver=verbose, **kwargs)
    except (ConnectionError, TimeoutError, OSError) as e:
        raise ClusterUnavailable(
            f"control.ray_address={shown_address(control.ray_address)!r}: no Ray cluster answers there "
            f"({redact_error(e, control.ray_address)}). Start one "
            f"(`ray start --head` on the head node, `ray start --address=HEAD:6379` on the others) or leave "
            f"control.ray_address unset for a private Ray instance on this machine"
        ) from e
    if control.ray_address is None:
        private_session_dir()
    warn_if_open_cluster(control.ray_address)  # the private instance too: RAY_AUTH_MODE=disabled
    if control.ray_address is not None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info(
            "attached to Ray cluster at %s: %d node(s), resources %s",
            shown_address(control.ray_address),
            len(nodes),
            ray.cluster_resources(),
        )


def private_session_dir() -> None:
    """Make the private instance's session directory (its sockets, logs, runtime envs) this
    user's only: Ray makes every directory it creates 0777 for machines shared between users,
    which lets them plant files in the run's runtime environments and read its logs. Ray 2.60
    offers no way to bind its GCS, raylet and worker ports to loopback; its token (on for a
    private instance unless RAY_AUTH_MODE says otherwise) is what guards them."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    try:
        os.chmod(node.get_session_dir_path(), 0o700)
    except OSError as e:
        log.warning("could not make Ray's session directory private: %s", e)


def shown_address(address: str | None) -> str | None:
    """A Ray address as logs and errors may show it: a password in it (``ray://user:pw@HEAD``,
    a proxy's credentials) removed."""
    if address is None or "://" not in address:
        return None if address is None else address.rpartition("@")[2]  # HOST:PORT, no user info
    return redact_url(address)


def redact_error(error: BaseException, address: str | None) -> str:
    """`error`'s text with the address in it shown as shown_address shows it."""
    text = str(error)
    return text.replace(address, shown_address(address) or "") if address else text


def probe(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast on a HOST:PORT nobody listens on: Ray's own GCS client retries for minutes."""
    if address is None or address in ("local", "auto"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition("@")[2].rpartition(":")
    if not sep or not port.isdigit():
        return  # let Ray parse (and reject) anything else
    with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
        pass


def open_cluster_warning(
    address: str | None, token_sent: bool, tokenless_accepted: bool | None = None, *, key: str = "control.ray_address"
) -> str | None:
    """The warning for having attached to `address` (named by `key`), or None.

    The private instance this process starts itself (no address, or "local") is open when
    it was started without token authentication (``RAY_AUTH_MODE=disabled``; Ray turns it on
    for a new local instance otherwise). Any other cluster is open when this process got in
    without sending a token (a cluster that requires one refuses such a client), or when it
    sends one but the GCS also answered a request without it (`tokenless_accepted`; None:
    not asked)."""
    if address in (None, "local"):
        if token_sent:
            return None
        return (
            "the run's private Ray instance was started without token authentication "
            "(RAY_AUTH_MODE=disabled): any user of this machine, and anyone who can reach its ports, "
            "can run code as its user. Unset RAY_AUTH_MODE (Ray then starts it with a token) or set "
            "RAY_AUTH_MODE=token"
        )
    if token_sent and not tokenless_accepted:
        return None
    return (
        f"{key}={shown_address(address)!r}: attached to a Ray cluster without token authentication: anyone who "
        "can reach its ports (GCS, Ray Client, dashboard) can run code as its user. Start the "
        "cluster with RAY_AUTH_MODE=token and give this process the token (docs/multinode.md)"
    )


def token_auth_enabled() -> bool:
    """Whether this process's Ray connections carry a token (RAY_AUTH_MODE=token, or Ray
    turned it on for `auto` because a token file exists)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication: nothing is ever sent
        return False
    return is_token_auth_enabled()


def gcs_accepts_tokenless(gcs_address: str, timeout_s: float = 5.0) -> bool | None:
    """Ask the GCS for its cluster id over a plain gRPC channel, without the token Ray's own
    channels add: True if it answers, False if it refuses for want of a token, None if the
    question itself failed (unreachable, another Ray)."""
    try:
        import grpc  # type: ignore[import-untyped]  # Ray's own dependency
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    try:
        with grpc.insecure_channel(gcs_address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # generated
            stub.GetClusterId(request, timeout=timeout_s)
        return True
    except grpc.RpcError as e:
        return False if e.code() == grpc.StatusCode.UNAUTHENTICATED else None


def _attached_gcs() -> str | None:
    """The GCS address of the cluster this process attached to (None through Ray Client)."""
    import ray

    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # Ray Client's context has no GCS address
        return None
    return address if isinstance(address, str) and address else None


_warned_open: set[str] = set()


def warn_if_open_cluster(
    address: str | None,
    *,
    key: str = "control.ray_address",
    token_sent: bool | None = None,
    tokenless_accepted: bool | None = None,
) -> None:
    """After ray.init: warn once per address and process when the cluster is open. The
    defaults (None) ask Ray whether this process sends a token and, if it does, ask the
    attached cluster's GCS whether it answers without one."""
    if str(address) in _warned_open:
        return
    sent = token_auth_enabled() if token_sent is None else token_sent
    if sent and tokenless_accepted is None and address not in (None, "local"):
        gcs = _attached_gcs()
        tokenless_accepted = gcs_accepts_tokenless(gcs) if gcs else None
    message = open_cluster_warning(address, sent, tokenless_accepted, key=key)
    if message is not None:
        _warned_open.add(str(address))
        log.warning(message)


def lost_actors(placed: dict[str, tuple[object, str]], wait_s: float = 30.0) -> list[str]:
    """What became of a run's actors (name -> (handle, node id where it was placed)) that are
    no longer alive where they were, one line each; [] when none was lost.

    A node that died (its raylet killed, the host gone) is declared dead by the GCS seconds
    after the first actor error reaches us; after such an error (``wait_s`` > 0) we wait up to
    that long for every lost actor's node to be declared, so the report says which node took
    which actor instead of a bare "actor died"."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    # This process runs on its own node, so that node is alive: an actor lost there lost only
    # its process, and waiting for the GCS to declare the node dead would only delay the report
    # (on a single machine, every failure's).
    here = _own_node_id()
    while True:
        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
        states = {name: actor_state(handle) for name, (handle, _) in placed.items()}
        lost = [
            name
            for name, (_, node) in placed.items()
            if node in dead_nodes or states[name][0] != "ALIVE" or states[name][1] != node
        ]
        settled = all(placed[name][1] in dead_nodes or placed[name][1] == here for name in lost)
        if (lost and settled) or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    lines = []
    for name in lost:
        node = placed[name][1]
        state, now_on = states[name]
        where = f"node {node[:12]} ({'dead' if node in dead_nodes else 'alive'})"
        if state == "ALIVE":
            fate = f"restarted by Ray on node {now_on[:12]}"
        elif state in STARTING:
            fate = "restarting: Ray re-creates it once a node with its resources is up"
        else:
            fate = "lost (not restartable: resume the run from its last checkpoint)"
        lines.append(f"{name} on {where}: {fate}")
    return lines


def _own_node_id() -> str | None:
    """The Ray node this process runs on (None through Ray Client, which has none here)."""
    import ray

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # Ray Client's context has no node of ours
        return None
    return node if isinstance(node, str) and node else None
