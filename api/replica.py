"""`serve --replica-name NAME`: every response says which replica answered (``x-vlmserve-replica``).

A pure ASGI middleware, so streamed responses and errors raised anywhere in the app carry it too; a load
balancer in front (``vlmserve cluster``) passes it through to the client.
"""

from __future__ import annotations

REPLICA_HEADER = b"x-vlmserve-replica"


class ReplicaHeader:
    def __init__(self, app, name: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER, name.encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)
