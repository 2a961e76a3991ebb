"""`python -m bench.floor_proxy --port N --upstream URL`: the least an aiohttp proxy can do per request,
on the gateway's own parts, to read `bench throughput`'s gateway rows against.

It serves POST /v1/chat/completions and /v1/completions as the gateway's server does (aiohttp on
uvloop where installed) and forwards each body, unread, to one replica with the gateway's upstream
client (gateway.forward.upstream_client), answering with the replica's status and body. No routing,
no index, no metrics, no header rules: what is left between its requests/s and the gateway's is the
gateway's own work per request, not its HTTP stack's.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from gateway.forward.upstream_client import UpstreamClient
from protocol.serving import new_event_loop

CLIENT = web.AppKey("client", UpstreamClient)
UPSTREAM = web.AppKey("upstream", str)
FORWARDED = ("/v1/chat/completions", "/v1/completions")


async def forward(request: web.Request) -> web.Response:
    raw = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    upstream = await request.app[CLIENT].request(
        "POST", request.app[UPSTREAM], request.path, raw, headers, connect_s=10, read_s=30
    )
    try:
        body = await upstream.read()
    finally:
        upstream.release()
    content_type = upstream.headers.get("Content-Type", "application/json")
    return web.Response(body=body, status=upstream.status, headers={"Content-Type": content_type})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def app(upstream: str) -> web.Application:
    application = web.Application()
    application[UPSTREAM] = upstream

    async def client(application: web.Application):  # the client needs the running loop
        application[CLIENT] = UpstreamClient()
        yield
        application[CLIENT].close()

    application.cleanup_ctx.append(client)
    application.router.add_get("/health", health)
    for path in FORWARDED:
        application.router.add_post(path, forward)
    return application


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the replica's base URL")
    args = parser.parse_args(argv)
    web.run_app(
        app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        loop=new_event_loop(),
    )


if __name__ == "__main__":
    main()
