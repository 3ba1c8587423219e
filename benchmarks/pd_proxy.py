"""The front of a vLLM prefill/decode pair joined by its NixlConnector.

    python -m benchmarks.pd_proxy --port 8100 --prefill http://127.0.0.1:8101 \\
        --decode http://127.0.0.1:8102

vLLM's disaggregated serving needs a router in front, as ours has: each
completion goes first to the prefill instance as a one-token, non-streaming
request marked `do_remote_decode` (it computes the prompt's KV and keeps it
for a remote reader); its answer carries `kv_transfer_params` (which blocks,
on which engine), which the proxy hands to the decode instance with the
original request. The decode instance pulls the blocks over NIXL and streams
the completion back through the proxy unchanged.

Used by `benchmarks.serve_compare` for the "vLLM 1P1D" rows.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

_PREFILL_ONLY = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Options of the client's request that a one-token prefill must not carry.
_DECODE_ONLY_KEYS = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's version of a completion request: one token, no stream."""
    request = {k: v for k, v in body.items() if k not in _DECODE_ONLY_KEYS}
    request.update(stream=False, max_tokens=1, kv_transfer_params=dict(_PREFILL_ONLY))
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The original request, plus where the decode instance finds the prompt's KV."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def build_app(prefill_url: str, decode_url: str) -> FastAPI:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    prefill = httpx.AsyncClient(base_url=prefill_url, timeout=None, limits=limits)
    decode = httpx.AsyncClient(base_url=decode_url, timeout=None, limits=limits)
    app = FastAPI()

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        answer = await prefill.post(path, json=prefill_request(body))
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = await decode.send(
            decode.build_request("POST", path, json=decode_request(body, answer.json())),
            stream=True,
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        media_type = upstream.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), upstream.status_code, media_type=media_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await decode.get("/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for client in (prefill, decode):
            if (await client.get("/health")).status_code != 200:
                return JSONResponse({"status": "waiting"}, 503)
        return JSONResponse({"status": "ok"})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    parser.add_argument("--decode", required=True, help="base URL of the decode instance")
    args = parser.parse_args(argv)
    app = build_app(args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
