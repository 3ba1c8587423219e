"""A whole serving cluster in one object: workers, router and HTTP server.

    async with ServingCluster(config, plan) as serving:
        print(serving.url)            # every worker is healthy, the port is bound
        await serving.wait_stopped()  # until SIGINT/SIGTERM (or stop())

Leaving the block stops the HTTP server, the router's pollers, every actor
and placement group, and a local Ray started for it. Used by `disagg serve`
and `disagg demo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import uvicorn

from cluster.api.image_prompt import ImageSupport
from cluster.api.request_prep import ServedModel
from cluster.api.server import ServerLimits, build_app
from cluster.config.plan import ClusterPlan
from cluster.config.schema import ClusterConfig
from cluster.launch.launcher import LaunchError, RunningCluster, connect_ray, launch
from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import WorkerEndpoint
from cluster.routing.worker_socket import StreamBrokenError
from runtime.cancellation import cancel_and_wait
from runtime.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


class ServingCluster:
    def __init__(
        self, config: ClusterConfig, plan: ClusterPlan, log_level: str = "warning"
    ) -> None:
        self.config = config
        self.plan = plan
        self.log_level = log_level
        self.metrics = ServingMetrics()
        self.cluster: RunningCluster | None = None
        self.router: Router | None = None
        self._server: uvicorn.Server | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._address: tuple[str, int] | None = None  # where the socket was bound
        self._stop = asyncio.Event()
        self._stop_signal: signal.Signals | None = None  # SIGINT or SIGTERM, once one came

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API, e.g. `http://127.0.0.1:8000/v1`.

        The address is read when the port is bound: the HTTP server closes its
        socket when it exits, and the URL stays what it was."""
        assert self._address is not None, "the server is not started"
        host, port = self._address
        return f"http://{host}:{port}/v1"

    def stop(self) -> None:
        self._stop.set()

    async def __aenter__(self) -> ServingCluster:
        # Take the port before starting any worker, so a busy port fails fast.
        listener = _bind(self.config.hostname, self.config.port)
        self._socket = listener
        self._address = listener.getsockname()[:2]
        try:
            self.cluster = await self._launch()
        except BaseException:
            listener.close()
            raise
        try:
            await self._start_http(listener)
            await self._connect_router()
            freeze_startup_heap()  # router, app and tokenizer are built
        except BaseException:
            await self._close()
            raise
        return self

    async def _launch(self) -> RunningCluster:
        # Ray installs its own SIGTERM handler when it connects; take the
        # signals back afterwards so a stop request always ends in `_close`.
        owns_ray = connect_ray(self.config.address, self.plan.num_cpus)
        self._catch_signals()
        launching = asyncio.ensure_future(
            launch(self.plan, self.config.startup_timeout_s, owns_ray=owns_ray)
        )
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([launching, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not launching.done():  # a signal arrived while starting: clean up, leave
            await cancel_and_wait(launching)
            raise KeyboardInterrupt("interrupted while starting the workers")
        return launching.result()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self._close())

    async def wait_stopped(self) -> None:
        """Return once a signal or `stop()` asks the server to stop, or it exits."""
        assert self._server_task is not None
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([self._server_task, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if self._server_task.done() and not self._stop.is_set():
            self._server_task.result()  # raises what ended the HTTP server
            logger.warning("the HTTP server exited without a stop request")

    def _catch_signals(self) -> None:
        # While uvicorn runs it takes SIGINT/SIGTERM itself and re-raises them
        # after its graceful exit; both paths end up setting `_stop`.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._signalled, sig)

    def _signalled(self, sig: signal.Signals) -> None:
        # Said on stderr whatever the log level: a server that stops says why.
        if not self._stop.is_set():
            print(f"received {sig.name}, stopping", file=sys.stderr, flush=True)
            self._stop_signal = sig
        if self.router is not None:
            # A signal to the process group stops the local workers too.
            self.router.expect_stop()
        self._stop.set()

    async def _start_http(self, listener: socket.socket) -> None:
        assert self.cluster is not None
        for instance in self.cluster.instances:
            self.metrics.place_worker(instance.plan.name, instance.plan.role, instance.node_ip)
        self.router = build_router(self.cluster, self.config, self.metrics)
        limits = ServerLimits(
            api_key=self.config.api_key,
            max_body_bytes=self.config.max_request_body_bytes,
            max_queued_requests=self.config.router.max_queued_requests,
        )
        app = build_app(self.router, _served_model(self.config, self.plan), self.metrics, limits)
        server_config = uvicorn.Config(
            app, log_level=self.log_level, timeout_graceful_shutdown=5, lifespan="on"
        )
        self._server = uvicorn.Server(server_config)
        self._server_task = asyncio.ensure_future(self._server.serve(sockets=[listener]))
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises the server's startup error
                raise RuntimeError("the HTTP server exited during startup")
            await asyncio.sleep(0.02)

    async def _connect_router(self) -> None:
        """Open the router's event streams and call sockets to every worker
        before the URL is printed, so that the first request finds them open."""
        assert self.router is not None
        try:
            await self.router.connect()
        except StreamBrokenError as exc:  # the first request tries again
            logger.warning("%s", exc)

    async def _close(self) -> None:
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._server_task
        if self._socket is not None:
            self._socket.close()
        if self.router is not None:
            await self.router.stop()
        if self.cluster is not None:
            await self.cluster.shutdown(after_signal=self._stop_signal is not None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)


def _bind(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it Nagle's algorithm holds
    # each small SSE chunk until the client ACKs the previous one, which a
    # delayed ACK puts off by up to 40 ms, so the first tokens of a stream
    # would leave in one late burst.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise LaunchError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another port or hostname"
        ) from exc
    return listener


def build_router(cluster: RunningCluster, config: ClusterConfig, metrics: ServingMetrics) -> Router:
    """The router `disagg serve` puts over a launched cluster (also what the
    benchmarks that drive a router without HTTP use)."""

    def endpoints(role: str) -> list[WorkerEndpoint]:
        return [
            WorkerEndpoint(i.plan.name, i.actor, WorkerState(i.plan.name))
            for i in cluster.actors(role)
        ]

    block_size = {i.role: i.block_size for i in cluster.plan.instances}
    chunk = {i.role: i.max_num_tokens for i in cluster.plan.instances}
    # Chunks are offered by one rank to one rank: tensor-parallel instances
    # pull each rank's heads once the prompt is published.
    one_rank = all(i.tensor_parallel_size == 1 for i in cluster.plan.instances)
    pipelined = config.cache_transceiver.pipelined_transfer and "context" in chunk and one_rank
    settings = RoutingSettings(
        policy=config.router.type,
        max_local_prefill_length=config.conditional_disagg.max_local_prefill_length,
        context_block_size=block_size.get("context", block_size["generation"]),
        generation_block_size=block_size["generation"],
        hash_namespace=cluster.plan.hash_namespace,
        pipeline_above_tokens=chunk["context"] if pipelined else None,
        hold_first_token=config.router.first_token_at == "admission",
        stall_timeout_s=config.router.stall_timeout_s,
        hybrid=cluster.plan.is_hybrid,
        generation_keeps_sequences=all(
            i.enable_block_reuse and (i.snapshots is None or i.snapshots.at_end)
            for i in cluster.plan.instances
            if i.role == "generation"
        ),
    )
    return Router(endpoints("context"), endpoints("generation"), settings, metrics)


def _served_model(config: ClusterConfig, plan: ClusterPlan) -> ServedModel:
    from models.tokenizer import load_tokenizer

    checkpoint = Path(plan.checkpoint)
    aliases = (config.model, str(checkpoint.resolve()))
    tokenizer = load_tokenizer(checkpoint)
    return ServedModel(
        name=checkpoint.resolve().name,
        tokenizer=tokenizer,
        max_model_len=plan.max_model_len,
        vocab_size=plan.vocab_size,
        aliases=aliases,
        images=_image_support(checkpoint, tokenizer),
        media=config.media,
    )


def _image_support(checkpoint: Path, tokenizer: Any) -> ImageSupport | None:
    """The image path's settings for a VL checkpoint folder; None otherwise."""
    from models.hf_config import load_model_config
    from models.image_processing import load_image_processor_config

    if not (checkpoint / "config.json").is_file():  # a GGUF file: text only
        return None
    vision = load_model_config(checkpoint).vision
    if vision is None:
        return None
    return ImageSupport(
        vision=vision,
        processing=load_image_processor_config(checkpoint, vision),
        placeholder=tokenizer.decode([vision.image_token_id], skip_special_tokens=False),
    )
