#!/usr/bin/env python3
"""The image's HEALTHCHECK: GET /health of the server running as PID 1 on its --port.

The server is found from PID 1's command line (`lorafarm registry|router|replica ... --port N`,
default ports 8100 / 8000 / 8200); any other command (a one-shot like `devmodel`) counts as healthy.
Stdlib only, so it costs a Python start and one request.
"""

import sys
import urllib.request

DEFAULT_PORTS = {"registry": 8100, "router": 8000, "replica": 8200, "up": 8000}


def main() -> int:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return 0
    role = next((a for a in argv if a in DEFAULT_PORTS), None)
    if role is None:
        return 0
    port = DEFAULT_PORTS[role]
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            port = int(argv[i + 1])
        elif a.startswith("--port="):
            port = int(a.split("=", 1)[1])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as r:
            return 0 if r.status == 200 else 1
    except Exception as e:  # noqa: BLE001 - any failure is unhealthy
        print(f"{role} on port {port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
