"""Which files of handler/ one request visits on its way through a replica, and in what order.

    .venv/bin/python -m benchmarks.request_path [--base DIR] [--stream]

Starts a standalone replica in this process (uvicorn on 127.0.0.1, the generated dev model unless
--base), sends one chat completion for the base model, and records every Python call into handler/
from the request's send to its answer, per thread (the serving loop, the engine thread, helper
threads). A step is a call into another file than the one the thread was in; a return to a file the
thread already visited counts as a revisit. Printed: files visited, steps, revisits, and the path.
The figure behind docs/architecture.md's "one request's path" (issue 34: before and after the rooms).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
HANDLER = str(REPO / "handler") + "/"


def _replica_app(base: Path, port: int):
    try:  # the rooms (issue 34)
        from handler.serving.app import ReplicaConfig, create_app
    except ImportError:  # the flat handler/ before them
        from handler.app import ReplicaConfig, create_app
    cfg = ReplicaConfig(base_dir=base, port=port, pull_owned=False, disk_dir=Path("var") / "request-path")
    return create_app(cfg)


def trace_one_request(base: Path, stream: bool = False) -> dict[str, list[str]]:
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths: dict[str, list[str]] = collections.defaultdict(list)
    recording = threading.Event()

    def profile(frame, event, arg):
        if event != "call" or not recording.is_set():
            return
        f = frame.f_code.co_filename
        if f.startswith(HANDLER):
            rel = f[len(str(REPO)) + 1:]
            p = paths[threading.current_thread().name]
            if not p or p[-1] != rel:
                p.append(rel)

    # before the server starts: threads inherit threading.setprofile only when they start (3.11)
    threading.setprofile(profile)
    sys.setprofile(profile)
    server = uvicorn.Server(uvicorn.Config(_replica_app(base, port), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": base.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0, "stream": stream}
    httpx.post(url, json=body, timeout=120).raise_for_status()  # warm-up: lazy set-up is not the path
    time.sleep(0.5)  # the engine thread back to idle
    recording.set()
    httpx.post(url, json=body, timeout=120).raise_for_status()
    recording.clear()
    sys.setprofile(None)
    threading.setprofile(None)
    server.should_exit = True
    t.join(30)
    return dict(paths)


def summarise(paths: dict[str, list[str]]) -> dict:
    files = sorted({f for p in paths.values() for f in p})
    steps = sum(len(p) for p in paths.values())
    revisits = sum(len(p) - len(set(p)) for p in paths.values())
    return {"files": len(files), "steps": steps, "revisits": revisits, "file_list": files, "paths": paths}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=None, help="base model folder (default: the generated dev model)")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args(argv)
    base = args.base
    if base is None:
        from tests.conftest import _dev_model

        base = _dev_model("tiny")
    s = summarise(trace_one_request(base, args.stream))
    for name, p in s["paths"].items():
        role = "engine thread" if name == "lorafarm-engine" else "serving loop" if "(run)" in name else name
        print(f"{role}: {len(set(p))} files, {len(p)} steps, {len(p) - len(set(p))} revisits: "
              f"{' -> '.join(f.removeprefix('handler/') for f in p)}")
    print(f"files visited: {s['files']}; steps: {s['steps']}; revisits: {s['revisits']}")
    print("files:", ", ".join(s["file_list"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
