"""A stand-in OpenAI-compatible server (not one of our components): `/v1/models` with a chosen
`status` per model (and Ollama's `/api/tags` + `/api/ps` from the same table), and
`/v1/chat/completions` answering with the server's name, streamed or not.
It runs uvicorn in a thread on a free port and counts the requests it served."""

from __future__ import annotations

import json
import socket
import threading

import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from tests.waiting import wait_for


class StandIn:
    def __init__(self, name: str, models: dict[str, str | None], api_key: str | None = None,
                 refuse: tuple[str, ...] = ()):
        self.name = name
        self.refuse = refuse  # listed, but chat answers 404 {"error": "..."} as Ollama does
        self.models = models  # id -> status ("loaded", "unloaded", None: no status field)
        self.api_key = api_key
        self.chats = 0
        self.auth_seen: list[str] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _app(self) -> Litestar:
        me = self

        def _denied(request: Request) -> Response | None:
            me.auth_seen.append(request.headers.get("authorization", ""))
            if me.api_key and request.headers.get("authorization") != f"Bearer {me.api_key}":
                return Response({"error": {"message": "bad key", "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, status_code=401)
            return None

        @get("/v1/models")
        async def models(request: Request) -> Response:
            if (denied := _denied(request)) is not None:
                return denied
            data = []
            for mid, status in me.models.items():
                m = {"id": mid, "object": "model", "created": 0, "owned_by": me.name}
                if status is not None:
                    m["status"] = status
                data.append(m)
            return Response({"object": "list", "data": data})

        @post("/v1/chat/completions", status_code=200)
        async def chat(request: Request) -> Response | Stream:
            if (denied := _denied(request)) is not None:
                return denied
            body = await request.json()
            if body.get("model") not in me.models or body.get("model") in me.refuse:
                return Response({"error": f"model {body.get('model')!r} not found"}, status_code=404)
            me.chats += 1
            text = f"from {me.name}"
            if not body.get("stream"):
                return Response({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

            async def events():
                for piece in (text[:4], text[4:]):
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return Stream(events(), media_type="text/event-stream")

        @get("/api/tags")
        async def tags() -> Response:  # Ollama: installed models
            return Response({"models": [{"name": m, "model": m} for m in me.models]})

        @get("/api/ps")
        async def ps() -> Response:  # Ollama: loaded models
            return Response({"models": [{"name": m, "model": m} for m, st in me.models.items() if st == "loaded"]})

        return Litestar(route_handlers=[models, chat, tags, ps], openapi_config=None)

    def start(self) -> StandIn:
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started, 60, interval=0.02,
                 what=f"the stand-in serving on port {self.port}")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


if __name__ == "__main__":  # a stand-in as its own process: python -m tests.e2e.standin NAME PORT MODEL
    import sys

    name, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    s = StandIn(name, {model: "loaded"})
    s.port, s.url = port, f"http://127.0.0.1:{port}"
    uvicorn.run(s._app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
