"""The Python transceiver over the UCX wire: bytes, bridging, handshake, dead
peers, and the `cache_transceiver.wire` setting from the YAML to the worker.

Transfer tests are skipped where `ucxx` is not installed (`pip install
'disagg[ucx]'`). The skip looks the package up without importing it:
importing ucxx at collection would run its import-time setup in every test
process, UCX tests or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from cluster.config.plan import resolve_plan
from cluster.config.schema import ConfigError, config_from_dict
from engine.worker_config import WorkerConfig, WorkerConfigError
from kvcache.spec import CacheSpec
from models.embedded.configs import checkpoint_config
from tests.head_shards import HYBRID_WHOLE
from tests.transfer_harness import BLOCK_SIZE, HYBRID, Endpoint, check_head_slice_exchange
from transfer.errors import LayoutMismatch, PeerGone, WireError
from transfer.factory import create_transceiver
from transfer.handle import TransferHandle
from transfer.python.frames import MAX_HEADER_BYTES, recv_header, send_header
from transfer.python.transceiver import PythonTransceiver
from transfer.python.ucx_wire import SMALL_FRAME_BYTES, UcxWire, ucx_importable
from transfer.python.wires import WireUnavailable, resolve_wire

needs_ucx = pytest.mark.skipif(
    not ucx_importable(), reason="ucxx is not installed; pip install 'disagg[ucx]'"
)

SECRET = b"cluster-secret"
# One event loop for the module, so one UCX context serves every test (as it
# serves every transceiver of a worker process): starting and resetting one
# per test would cost about a second each (ucxx's notifier thread wakes once
# a second to notice it should stop).
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module", autouse=True)
async def ucx_context() -> AsyncIterator[None]:
    if not ucx_importable():
        yield
        return
    keeper = UcxWire()
    keeper._context()
    yield
    await keeper.close()


def ucx_endpoint(
    manager: str,
    spec: CacheSpec = HYBRID,
    secret: bytes = SECRET,
    num_blocks: int = 16,
    stage: bool = False,
) -> Endpoint:
    """A pool with a Python transceiver listening on UCX (not started)."""
    return Endpoint(
        manager,
        lambda buffers: PythonTransceiver(
            buffers, secret, wire="ucx", connect_timeout_s=2.0, stage_through_host=stage
        ),
        spec,
        num_blocks=num_blocks,
    )


@pytest_asyncio.fixture(loop_scope="module")
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    src_kind, dst_kind = getattr(request, "param", ("v2", "v2"))
    src, dst = ucx_endpoint(src_kind), ucx_endpoint(dst_kind)
    await src.xcvr.start()
    await dst.xcvr.start()
    yield src, dst
    await dst.xcvr.close()
    await src.xcvr.close()


@needs_ucx
@pytest.mark.parametrize("pair", [("v1", "v1"), ("v2", "v2"), ("v1", "v2")], indirect=True)
@module_loop
async def test_moves_kv_and_mamba_bytes_exactly_over_ucx(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = pair
    free_before = src.manager.num_free_blocks
    sent = src.fill("r1", 3 * BLOCK_SIZE - 1)
    handle = TransferHandle.from_bytes(src.publish("r1").to_bytes())
    assert handle.wire == "ucx" and handle.peer.startswith("ucx://")
    await dst.pull(handle, 3 * BLOCK_SIZE - 1)
    assert dst.segments("r1") == sent
    assert src.released == ["r1"]
    assert src.manager.num_free_blocks == free_before
    # A second pull reuses the pooled, already authenticated endpoint.
    again = src.fill("r2", BLOCK_SIZE)
    await dst.pull(src.publish("r2"), BLOCK_SIZE)
    assert dst.segments("r2") == again
    src.manager.check_integrity()
    dst.manager.check_integrity()


@needs_ucx
@pytest.mark.parametrize("stage", [False, True])
@module_loop
async def test_ranges_larger_than_a_payload_piece_arrive_whole(stage: bool) -> None:
    """~17.5 MiB in one V2 range: three 8 MiB messages, sent and received in step
    (zero-copy from the pool, or through staging chunks as device pools go)."""
    big = CacheSpec(num_kv_heads=16, head_dim=256, attention_layers=(0, 1))  # 256 KiB blocks
    src = ucx_endpoint("v2", big, num_blocks=80, stage=stage)
    dst = ucx_endpoint("v2", big, num_blocks=80, stage=stage)
    await src.xcvr.start()
    await dst.xcvr.start()
    try:
        sent = src.fill("r1", 70 * BLOCK_SIZE)
        await dst.pull(src.publish("r1"), 70 * BLOCK_SIZE)
        assert dst.segments("r1") == sent
    finally:
        await dst.xcvr.close()
        await src.xcvr.close()


def staged_ucx_endpoint(manager: str, spec: CacheSpec, stage: bool, num_blocks: int) -> Endpoint:
    return ucx_endpoint(manager, spec, num_blocks=num_blocks, stage=stage)


# A head of a block is 4 x 256 float32 = 4 KiB.
LONG_RUNS = CacheSpec(num_kv_heads=4, head_dim=256, attention_layers=(0, 1))


@needs_ucx
@pytest.mark.parametrize(
    "whole,ctx_size,gen_size,staged,num_blocks",
    [
        (HYBRID_WHOLE, 1, 2, (False, False), 3),
        # One message per run on both sides, staged or not.
        (HYBRID_WHOLE, 1, 2, (True, False), 3),
        (HYBRID_WHOLE, 1, 2, (False, True), 3),
        (LONG_RUNS, 1, 2, (True, True), 3),
        (LONG_RUNS, 1, 2, (True, False), 24),
    ],
)
@module_loop
async def test_head_slices_cross_as_messages_staged_or_not(
    whole: CacheSpec,
    ctx_size: int,
    gen_size: int,
    staged: tuple[bool, bool],
    num_blocks: int,
) -> None:
    """Tensor-parallel pulls over UCX, where a holder that gathers runs into
    staging chunks must still send one message per run that a puller
    receiving in place (or through its own chunks) expects."""
    await check_head_slice_exchange(
        staged_ucx_endpoint, whole, ctx_size, gen_size, ("v1", "v1"), staged, num_blocks
    )


@needs_ucx
@module_loop
async def test_concurrent_pulls_share_the_byte_budget_over_ucx(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = pair
    src.xcvr._holder._budget.limit = 1024  # far below a request: the streams interleave
    sent = {f"r{i}": src.fill(f"r{i}", 2 * BLOCK_SIZE) for i in range(4)}
    handles = [src.publish(rid) for rid in sent]
    await asyncio.gather(*(dst.pull(h, 2 * BLOCK_SIZE) for h in handles))
    for rid, contents in sent.items():
        assert dst.segments(rid) == contents
    assert sorted(src.released) == sorted(sent)


@needs_ucx
@module_loop
async def test_wrong_secret_is_refused_and_holder_stays_pinned(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, _ = pair
    intruder = ucx_endpoint("v2", secret=b"guess")
    await intruder.xcvr.start()
    try:
        src.fill("r1", BLOCK_SIZE)
        with pytest.raises(WireError, match="secret"):
            await intruder.pull(src.publish("r1"), BLOCK_SIZE)
        assert src.xcvr.num_pinned == 1 and src.released == []
    finally:
        await intruder.xcvr.close()


@needs_ucx
@module_loop
async def test_holder_closed_mid_transfer_gives_peer_gone(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.fill("r1", 2 * BLOCK_SIZE)
    handle = src.publish("r1")
    budget = src.xcvr._holder._budget
    await budget.acquire(budget.limit)  # the holder announces the data, then stalls
    pull = asyncio.create_task(dst.pull(handle, 2 * BLOCK_SIZE))
    while not src.xcvr._holder._serving:
        await asyncio.sleep(0.01)
    await src.xcvr.close()
    with pytest.raises(PeerGone, match="r1"):
        await pull
    assert not dst.manager.has_request("r1")
    dst.manager.check_integrity()


@needs_ucx
@module_loop
async def test_closed_holder_gives_peer_gone(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1")
    await src.xcvr.close()
    with pytest.raises(PeerGone, match="cannot connect"):
        await dst.pull(handle, BLOCK_SIZE)
    assert not dst.manager.has_request("r1")


@needs_ucx
@module_loop
async def test_header_frames_of_every_size_cross_intact() -> None:
    """Frames up to SMALL_FRAME_BYTES travel as one message, larger ones as two."""
    received: asyncio.Queue[dict[str, object]] = asyncio.Queue()
    server, client = UcxWire(), UcxWire()

    async def serve(conn: object) -> None:
        for _ in range(3):
            await received.put(await recv_header(conn, MAX_HEADER_BYTES))  # type: ignore[arg-type]

    endpoint = await server.listen("127.0.0.1", 0, serve)
    conn = await client.connect(endpoint, 2.0)
    try:
        sizes = [10, SMALL_FRAME_BYTES - 40, 3 * SMALL_FRAME_BYTES]
        for n in sizes:
            await send_header(conn, {"t": "blob", "b": os.urandom(n)})
        got = [await asyncio.wait_for(received.get(), 5) for _ in sizes]
        assert [len(h["b"]) for h in got] == sizes  # type: ignore[arg-type]
    finally:
        conn.close()
        await client.close()
        await server.close()


@needs_ucx
def test_wire_resolution_where_ucxx_imports(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_wire("tcp") == "tcp"
    assert resolve_wire("ucx") == "ucx"
    with caplog.at_level(logging.WARNING, logger="transfer.factory"):
        assert resolve_wire("auto") == "ucx"  # ucxx imports here
    assert "cache_transceiver.wire auto -> 'ucx'" in caplog.text
    with pytest.raises(WireUnavailable, match="cache_transceiver.wire"):
        resolve_wire("rdma")


@needs_ucx
def test_importing_ucxx_leaves_the_process_environment_alone() -> None:
    """ucxx's import-time UCX settings go to its own context, not to os.environ
    (checked in a fresh process: this one imported ucxx already)."""
    script = (
        "import json, os\n"
        "from transfer.python import ucx_wire\n"
        "before = dict(os.environ)\n"
        "ucx_wire.import_ucxx()\n"
        "print(json.dumps([dict(os.environ) == before, ucx_wire._context_options]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    unchanged, options = json.loads(out.stdout.strip().splitlines()[-1])
    assert unchanged
    assert options["RNDV_THRESH"] == "8192"  # what ucxx would have exported


@needs_ucx
@module_loop
async def test_a_tcp_only_puller_refuses_a_ucx_handle_naming_the_extra(
    pair: tuple[Endpoint, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = pair
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1")

    def no_ucxx() -> None:
        raise ImportError("No module named 'ucxx'")

    monkeypatch.setattr("transfer.python.ucx_wire.import_ucxx", no_ucxx)
    with pytest.raises(LayoutMismatch, match=r"disagg\[ucx\]"):
        await dst.pull(handle, BLOCK_SIZE)
    async with asyncio.timeout(5):  # the refused pull releases the holder at once
        while src.xcvr.num_pinned:
            await asyncio.sleep(0.01)
    assert src.released == ["r1"]


def _no_ucxx() -> None:
    raise ImportError("No module named 'ucxx'")


def test_wire_resolution_without_ucxx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("transfer.python.ucx_wire.import_ucxx", _no_ucxx)
    assert resolve_wire("auto") == "tcp"
    with pytest.raises(WireUnavailable, match=r"pip install 'disagg\[ucx\]'"):
        resolve_wire("ucx")


def test_asking_for_ucx_without_ucxx_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cluster.config.schema.ucx_importable", lambda: False)
    raw = {"model": "unused", "generation_servers": {"cache_transceiver": {"wire": "ucx"}}}
    with pytest.raises(
        ConfigError, match=r"generation_servers.cache_transceiver.wire: .*disagg\[ucx\]"
    ):
        config_from_dict(raw)
    assert config_from_dict({"model": "unused", "cache_transceiver": {"wire": "auto"}})


def test_the_wire_flows_from_the_yaml_to_every_worker(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    raw = {"model": str(tmp_path), "cache_transceiver": {"backend": "python", "wire": "auto"}}
    plan = resolve_plan(config_from_dict(raw))
    configs = [i.worker_config("ckpt", "secret", "127.0.0.1") for i in plan.instances]
    assert [c.transfer_wire for c in configs] == ["auto", "auto"]
    default = resolve_plan(config_from_dict({"model": str(tmp_path)}))
    assert {i.transfer_wire for i in default.instances} == {"tcp"}
    with pytest.raises(WorkerConfigError, match="transfer_wire"):
        WorkerConfig(checkpoint="unused", transfer_wire="rdma")


@pytest.mark.parametrize("wire", ["tcp", pytest.param("ucx", marks=needs_ucx)])
@module_loop
async def test_a_worker_listens_and_publishes_on_its_configured_wire(wire: str) -> None:
    buffers = {"kv": torch.zeros(4096, dtype=torch.uint8)}
    xcvr = create_transceiver("python", buffers, secret=b"s", wire=wire)
    assert isinstance(xcvr, PythonTransceiver) and xcvr.wire == wire
    await xcvr.start()
    try:
        assert xcvr.endpoint[0] == "127.0.0.1"
    finally:
        await xcvr.close()
