"""Where the learner ranks run: one placement-group bundle per rank, on any node of the cluster.

    pg, bundles = reserve_ranks(cfg.learner, num_ranks)     # waits until Ray can place them all
    actor_cls.options(**rank_options(pg, bundles[r]))       # rank r -> its bundle
    release(pg)

Each bundle is ``{CPU: cpus_per_rank, GPU: gpus_per_rank, **learner.resources}``; the
strategy (``learner.placement``) is Ray's: PACK keeps ranks together where they fit,
SPREAD puts them on different nodes where it can, the STRICT_ forms insist. Rank 0 gets a
bundle on the driver's node when there is one: it assembles and exports the full weights,
and the driver's weight sync then reads them on its own host.

The rendezvous address and port come from rank 0's node (``rendezvous_point``, run on that
actor), never from the driver: 127.0.0.1 on the driver is nobody's address on another node.
"""

from __future__ import annotations

import time

from asyncrl.config import LearnerConfig
from asyncrl.infra import free_port


class PlacementError(RuntimeError):
    """The cluster cannot host the learner ranks as configured."""


def rank_bundle(lc: LearnerConfig) -> dict[str, float]:
    bundle = {"CPU": float(lc.cpus_per_rank), **{k: float(v) for k, v in lc.resources.items()}}
    if lc.gpus_per_rank:
        bundle["GPU"] = float(lc.gpus_per_rank)
    return bundle


def reserve_ranks(lc: LearnerConfig, num_ranks: int, timeout_s: float = 120.0):
    """A ready placement group of ``num_ranks`` bundles and the bundle index of each rank."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    bundle = rank_bundle(lc)
    pg = placement_group(
        [dict(bundle) for _ in range(num_ranks)], strategy=lc.placement, name=f"asyncrl-learner-{time.time_ns()}"
    )
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise PlacementError(
            f"learner: Ray could not place {num_ranks} rank(s) of {bundle} with learner.placement="
            f"{lc.placement!r} in {timeout_s:.0f} s; the cluster has {ray.available_resources()} free "
            f"(learner.resources / cpus_per_rank / gpus_per_rank must fit on its nodes)"
        )
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    # Stable sort: bundles on the driver's node first, so rank 0 lands there if it can.
    order = sorted(range(num_ranks), key=lambda i: nodes.get(i) != here)
    return pg, order


def rank_options(pg, bundle_index: int) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index
        )
    }


def release(pg) -> None:
    import contextlib

    from ray.util.placement_group import remove_placement_group

    if pg is not None:
        with contextlib.suppress(Exception):  # Ray already gone at interpreter exit
            remove_placement_group(pg)


def rendezvous_point() -> tuple[str, int]:
    """This node's address as the cluster knows it, and a port free on it (run on rank 0).

    The port is released before torch binds it; the window is short and a clash fails the
    rendezvous loudly (EADDRINUSE), it never joins the wrong group."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")
