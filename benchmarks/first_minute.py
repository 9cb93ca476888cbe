"""Issue 37's measurement: a fresh clone's `make serve` to the first chat answer through the router.

    python -m benchmarks.first_minute [--clone DIR] [--heldout N]

Clones this repository into DIR (default: a new temporary folder), runs `make serve` there, and the
moment "lorafarm is up." is printed chats to `demo/support:prod` with `temperature: 0` (the official
openai client, no retries: a 503 after the ready message fails the run). Prints the ready time, the
first answer's time and text, and writes every output line of `make serve` with its time into
DIR/first-minute.log; --heldout N also asks each demo alias N held-out prompts. pip's download cache is
whatever the machine has (state it: the README's table measures it warm)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = "lorafarm is up."
MODELS = ["smollm2-135m-instruct", "demo/support:prod", "demo/french:prod", "demo/json:prod", "demo/pirate:prod"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_minute", description=__doc__.splitlines()[0])
    p.add_argument("--clone", type=Path, help="where to clone (must not exist; default: a new temporary folder)")
    p.add_argument("--heldout", type=int, default=0, help="held-out prompts to ask each demo alias afterwards")
    a = p.parse_args(argv)
    clone = a.clone or Path(tempfile.mkdtemp(prefix="lorafarm-first-minute-")) / "lorafarm"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "serve"], cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready = None
    with open(clone / "first-minute.log", "w") as log:
        buf = ""
        while ready is None:
            ch = proc.stdout.read(1)
            if not ch:
                break
            buf += ch
            if ch in "\n\r":
                line, buf = buf.strip(), ""
                if line:
                    log.write(f"{time.monotonic() - t0:7.1f} {line}\n")
                    log.flush()
                if READY in line:
                    ready = time.monotonic() - t0
    try:
        if ready is None:
            print(f"make serve ended without {READY!r} (exit {proc.wait()}); see {clone / 'first-minute.log'}")
            return 1
        from openai import OpenAI

        farm = json.loads((clone / "var" / "farm.json").read_text())
        client = OpenAI(base_url=farm["router_url"] + "/v1", api_key=farm["tenants"][0]["api_key"], max_retries=0)
        r = client.chat.completions.create(model="demo/support:prod", max_tokens=48, temperature=0,
                                           messages=[{"role": "user", "content": "I never received my package."}])
        answer = time.monotonic() - t0
        print(f"ready {ready:.1f} s, first answer {answer:.1f} s: {r.choices[0].message.content!r}", flush=True)
        if a.heldout:
            prompts = json.loads((clone / "lorafarm/data/demo_adapters/heldout.json").read_text())[: a.heldout]
            for model in MODELS:
                for q in prompts:
                    rr = client.chat.completions.create(model=model, max_tokens=48, temperature=0,
                                                        messages=[{"role": "user", "content": q}])
                    print(json.dumps({"model": model, "prompt": q, "answer": rr.choices[0].message.content},
                                     ensure_ascii=False), flush=True)
        return 0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
