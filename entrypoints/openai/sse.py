"""Server-sent events exactly as OpenAI streams them: `data: {json}\\n\\n` per event, `data: [DONE]\\n\\n` last.

An error after the stream has started cannot change the HTTP status any more, so it is sent as one
`data: {"error": {...}}` event followed by `[DONE]` (vLLM's create_streaming_error_response).
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from hybridkv.entrypoints.openai.errors import OpenAIError


def dumps(obj: Any) -> str:
    # Compact separators: a long stream sends thousands of events.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class SSEStream:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # reverse proxies must not buffer the stream
            },
        )

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, obj: dict) -> None:
        await self.response.write(f"data: {dumps(obj)}\n\n".encode())

    async def send_error(self, error: OpenAIError) -> None:
        await self.send(error.body())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
