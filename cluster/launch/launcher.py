"""Start the worker actors of a `ClusterPlan` on Ray, and stop them again.

    join `address` (or start a local Ray)
    for each instance: placement group (CPU + GPU bundle)
                       -> actor(WorkerConfig, with where to get the checkpoint
                          when off the serving node: `cluster.launch.checkpoint_shipping`)
    wait until every actor started and reports healthy, within the timeout

If any instance fails to come up, everything this launcher started is
stopped (actors, placement groups, the checkpoint server, a local Ray) and
`LaunchError` names the instance and the reason. `RunningCluster.shutdown` is
idempotent and leaves no actor or placement group behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config.plan import ClusterPlan, InstancePlan
from cluster.launch.checkpoint_shipping import CheckpointShipping
from engine.process_env import worker_env

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SHUTDOWN_TIMEOUT_S = 10.0
# While waiting on Ray at shutdown, how often to check that it still runs.
_RAY_ALIVE_POLL_S = 0.2
# A worker process that dies (OOM, a crash, a killed node) is restarted by Ray
# this many times, in its placement group; the router routes around it until
# it answers polls again. Calls in flight when it died fail (no task retries):
# the router decides whether a request may run again.
MAX_RESTARTS = 4


class LaunchError(RuntimeError):
    """An instance did not come up; the message names it and says why."""


@dataclass
class LaunchedInstance:
    plan: InstancePlan
    actor: Any
    placement_group: PlacementGroup
    node_ip: str


@dataclass
class RunningCluster:
    plan: ClusterPlan
    instances: list[LaunchedInstance] = field(default_factory=list)
    owns_ray: bool = False
    # Serves the checkpoint to instances off the serving node, restarts included.
    shipping: CheckpointShipping | None = None
    _stopped: bool = False

    def actors(self, role: str) -> list[LaunchedInstance]:
        return [i for i in self.instances if i.plan.role == role]

    def placement(self) -> str:
        """Where each instance runs, one line each: `context-0 on 127.0.0.3`."""
        return "\n".join(f"{i.plan.name} on {i.node_ip}" for i in self.instances)

    async def shutdown(self, after_signal: bool = False) -> None:
        """Stop every actor (gracefully, then by force), remove the placement
        groups, stop the checkpoint server, and stop Ray if this process
        started it.

        `after_signal`: the stop follows SIGINT or SIGTERM, which a terminal's
        Ctrl-C or a supervisor sends to the whole process group, a local
        Ray's own processes included; finding that Ray gone is then the
        normal way down, not worth a warning.
        """
        if self._stopped:
            return
        self._stopped = True
        server = self.shipping.close() if self.shipping is not None else None
        if _local_ray_alive():
            await asyncio.gather(*(_stop_instance(i) for i in self.instances))
            if server is not None:
                await _ray_call(ray.kill, server)
        else:
            # A signal to the whole process group stopped our Ray first: its
            # actors and placement groups went with it, and every call to it
            # would only wait out its timeout.
            log = logger.info if after_signal else logger.warning
            log("the local Ray is gone; not stopping its actors one by one")
            if self.owns_ray:
                _kill_local_ray()
        self.instances.clear()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


# The node address of a local cluster. On loopback, Ray's servers (GCS,
# raylet, object manager, each worker's RPC server) and the transceivers,
# which listen where Ray places their node, are out of reach of other
# machines. Not 127.0.0.1 itself: given that, Ray advertises the machine's
# external address instead.
LOCAL_NODE_IP = "127.0.0.3"

# Ctrl-C in a terminal (SIGINT to the whole process group), like a SIGTERM
# to it, stops a local Ray's processes before this driver disconnects from
# them. Ray's driver shutdown then waits for two flushes to processes that
# are gone: its task events (up to 5 s by default) and its metrics (about
# 10 s), so the serve command took 10 s to exit. A local Ray of ours runs no
# dashboard, so nothing reads Ray's own metrics: they are off. Task events
# (what the dashboard shows of tasks) get a quarter second.
_LOCAL_RAY_ENV = {
    "RAY_enable_metrics_collection": "0",
    "RAY_task_events_shutdown_flush_timeout_ms": "250",
}
# A new local Ray turns token authentication on by itself, but warns at every
# start unless the mode was chosen explicitly: choose it (a user's own
# RAY_AUTH_MODE, `disabled` included, is kept).
_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def init_local_ray(
    num_cpus: int, runtime_env: dict[str, Any] | None = None, **options: Any
) -> None:
    """Start a Ray of this process's own on `LOCAL_NODE_IP`; `options` go to
    `ray.init`. "local" always starts one: without it Ray would join a
    cluster that `ray start` left running on this machine, or trip over the
    stale record (ray_current_cluster) of one that was stopped."""
    for name, value in _LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)  # read by every process of this Ray
    _choose_token_auth()
    env = dict(runtime_env or {})
    # UCX (under NIXL and the UCX wire) listens on every network device
    # unless told otherwise; a local cluster's transfers stay on this machine.
    devices = os.environ.get("UCX_NET_DEVICES", "lo")
    env["env_vars"] = {"UCX_NET_DEVICES": devices, **env.get("env_vars", {})}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env=env,
        _node_ip_address=LOCAL_NODE_IP,
        **options,
    )


def _choose_token_auth() -> None:
    """RAY_AUTH_MODE=token for a local Ray where the user set no mode: what
    Ray would choose, said explicitly so that it does not warn.

    Ray read its config when it was imported, so the config is read again,
    as Ray's own default does (`_enable_token_auth`); ray.init then writes
    the token file (~/.ray/auth_token) if there is none. Where that call is
    missing (Ray's internals moved) the variable is taken back and Ray
    decides, and warns, as before.
    """
    if os.environ.get(_AUTH_MODE_ENV) is not None:
        return
    os.environ[_AUTH_MODE_ENV] = "token"
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    except (ImportError, AttributeError):
        del os.environ[_AUTH_MODE_ENV]


def connect_ray(address: str | None, num_cpus: float) -> bool:
    """Join `address`, or start a local Ray (`init_local_ray`) with at least
    `num_cpus` CPUs (what the plan's instances ask for together); True when
    started here."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {"PYTHONPATH": _project_root()}}
    if address:
        try:
            ray.init(address=address, runtime_env=env, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise LaunchError(
                f"cannot join the Ray cluster at address {address!r}: {exc}; start it "
                "(`ray start --head` or `ray up deploy/ray/cluster-gpu.yaml`) or remove "
                "`address` from the config to run a local cluster"
            ) from exc
        return False
    # A local cluster grants every instance its num_cpus even on a smaller
    # machine: the grant sizes each worker's torch threads, it does not pin cores.
    cpus = max(os.cpu_count() or 1, math.ceil(num_cpus))
    init_local_ray(cpus, runtime_env=env, logging_level=logging.WARNING, log_to_driver=True)
    return True


async def launch(plan: ClusterPlan, timeout_s: float, owns_ray: bool = False) -> RunningCluster:
    """Start every instance of `plan` on the connected Ray (see `connect_ray`)
    and wait until all are healthy; `owns_ray` makes shutdown stop Ray too.

    Raises `LaunchError` (after stopping everything it started) when one
    fails or the timeout passes; cancelling the call cleans up the same way.
    """
    secret = secrets.token_hex(16)
    shipping = CheckpointShipping(plan.model_source, f"disagg-checkpoint-{secret[:8]}")
    cluster = RunningCluster(plan, owns_ray=owns_ray, shipping=shipping)
    starting = _start_all(plan, secret, shipping, cluster)
    try:
        await _within(starting, timeout_s, "starting the workers", plan)
    except BaseException:
        await asyncio.shield(cluster.shutdown())
        raise
    return cluster


async def _start_all(
    plan: ClusterPlan, secret: str, shipping: CheckpointShipping, cluster: RunningCluster
) -> None:
    """Start instances concurrently; the first failure cancels the rest, so
    nothing is still being created when the caller cleans up."""
    try:
        async with asyncio.TaskGroup() as group:
            for instance in plan.instances:
                group.create_task(_start_instance(instance, secret, shipping, cluster))
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None


async def _start_instance(
    instance: InstancePlan, secret: str, shipping: CheckpointShipping, cluster: RunningCluster
) -> None:
    bundle = {"CPU": instance.num_cpus, **instance.resources}
    if instance.num_gpus:
        bundle["GPU"] = instance.num_gpus
    # The secret's prefix keeps two deployments on one Ray cluster apart.
    label = f"disagg-{instance.name}-{secret[:8]}"
    # One bundle per tensor-parallel rank, packed onto one node; the worker
    # (rank 0) takes bundle 0 and starts the other ranks in the others.
    bundles = [bundle] * instance.tensor_parallel_size
    group = placement_group(bundles, strategy="STRICT_PACK", name=label)
    pending = LaunchedInstance(instance, None, group, "")
    cluster.instances.append(pending)
    try:
        await group.ready()
        node_id, pending.node_ip = _node_of(group)
        source = await shipping.source_for(node_id)
        # No transfer host: the worker listens on its node's address, which
        # changes when Ray restarts it on another node.
        config = instance.worker_config(cluster.plan.checkpoint, secret, "", source)
        pending.actor = (
            _actor_class(instance.role)
            .options(
                num_cpus=instance.num_cpus,
                num_gpus=instance.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0
                ),
                name=label,
                max_concurrency=1000,
                max_restarts=MAX_RESTARTS,
                runtime_env={"env_vars": worker_env(instance.device)},
            )
            .remote(config, instance.name, *_role_argument(instance))
        )
        await pending.actor.start.remote()
        health = await pending.actor.health.remote()
    except Exception as exc:
        raise LaunchError(f"instance {instance.name} failed to start: {_reason(exc)}") from exc
    if not health.healthy:
        raise LaunchError(f"instance {instance.name} is unhealthy after start: {health.detail}")
    logger.info("%s ready on %s", instance.name, pending.node_ip)


def _actor_class(role: str) -> Any:
    if role == "context":
        from prefill_worker.worker import ContextWorker

        return ray.remote(ContextWorker)
    from decode_worker.worker import GenerationWorker

    return ray.remote(GenerationWorker)


def _role_argument(instance: InstancePlan) -> tuple[str, ...]:
    """The generation actor's `role` argument; a context actor takes none."""
    return () if instance.role == "context" else (instance.worker_role,)


def _node_of(group: PlacementGroup) -> tuple[str, str]:
    """The ID and IP of the node the group's bundles landed on."""
    node_id = str(placement_group_table(group)["bundles_to_node_id"][0])
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node_id, str(node["NodeManagerAddress"])
    return node_id, "127.0.0.1"


async def _stop_instance(instance: LaunchedInstance) -> None:
    """Stop the actor (gracefully, then by force), then remove its placement group."""
    if instance.actor is not None:
        try:
            await _unless_ray_dies(instance.actor.shutdown.remote())
        except Exception as exc:  # already dead or stuck: kill it below anyway
            logger.debug("graceful shutdown of %s failed: %s", instance.plan.name, exc)
        await _ray_call(ray.kill, instance.actor, no_restart=True)
    await _ray_call(remove_placement_group, instance.placement_group)


def _local_ray_alive() -> bool:
    """False once a Ray this process started has lost one of its processes.

    A joined cluster's processes are not ours to watch: True.
    """
    node = _local_node()
    if node is None:
        return True
    try:
        return bool(node.remaining_processes_alive())
    except Exception:  # Ray's internals moved: assume alive, the timeouts still bound us
        return True


def _local_node() -> Any:
    """The node of the Ray this process started (Ray's private handle), or
    None when it joined a cluster or runs none."""
    return getattr(ray._private.worker, "_global_node", None)


def _kill_local_ray() -> None:
    """SIGKILL what is left of the Ray this process started. Used once one of
    its processes died: they all had the signal that stopped it, and
    `ray.shutdown()` would give each survivor a second of grace in turn."""
    node = _local_node()
    if node is None:
        return
    try:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    except Exception:  # Ray's internals moved: ray.shutdown() still stops them
        logger.warning("could not kill the local Ray's processes at once", exc_info=True)


async def _unless_ray_dies(work: Awaitable[T]) -> T | None:
    """Await `work` for up to the shutdown timeout, giving up early (None) when
    the local Ray dies meanwhile."""
    task = asyncio.ensure_future(work)
    deadline = asyncio.get_running_loop().time() + _SHUTDOWN_TIMEOUT_S
    while not task.done():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0 or not _local_ray_alive():
            task.cancel()
            logger.warning("Ray did not answer within %.0fs or is gone", _SHUTDOWN_TIMEOUT_S)
            return None
        await asyncio.wait([task], timeout=min(left, _RAY_ALIVE_POLL_S))
    return task.result()


async def _ray_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A blocking Ray API call, off the event loop and bounded in time.

    When Ray's control processes are already gone (a Ctrl-C that reached the
    whole process group), these calls never return; shutdown must not hang
    on them. A daemon thread, unlike the default executor, cannot keep the
    process alive at exit.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def call() -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            logger.debug("%s failed during shutdown: %s", fn.__name__, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed after a timeout
            loop.call_soon_threadsafe(finish)

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    threading.Thread(target=call, daemon=True, name=f"ray-{fn.__name__}").start()
    await _unless_ray_dies(done)


async def _within(work: Awaitable[T], timeout_s: float, what: str, plan: ClusterPlan) -> T:
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except TimeoutError:
        names = ", ".join(i.name for i in plan.instances)
        raise LaunchError(
            f"{what} took longer than {timeout_s:.0f}s (instances: {names}); check that the "
            "Ray cluster has the CPUs/GPUs the config asks for, or raise startup_timeout_s"
        ) from None


def _reason(exc: BaseException) -> str:
    # Ray wraps actor-side errors; the last line of the cause is the useful part.
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[2])
