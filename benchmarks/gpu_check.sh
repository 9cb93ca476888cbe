#!/usr/bin/env bash
# The engine's GPU check, in one go (about 3-5 minutes on one modern GPU):
#   1. correctness on cuda: runner logits == the CPU runner and PEFT merge_and_unload() (float32),
#      and canary isolation through the engine in bfloat16 (300 requests over the 32 canaries);
#   2. the same benchmarks as on CPU (layer op at 7B dims, engine throughput vs transformers + PEFT),
#      written to benchmarks/results/cuda-*.json and rendered into docs/benchmarks.md
#      (docs/bench_lora_layer_cuda.png, docs/bench_engine_cuda.png).
#
# Usage, from anywhere:   benchmarks/gpu_check.sh [extra pytest args]
# Needs a CUDA build of torch in the venv, e.g.:
#   make dev TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126'
# PYTHON overrides the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch in $PY has no CUDA device; install a CUDA build first (see the header)" >&2
  exit 3
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

echo "== 1/2 correctness on cuda"
timeout 300 "$PY" - <<'EOF'
import json, sys, time
from pathlib import Path

import torch

from handler.engine import Engine, SamplingParams
from handler.lora import ModelLoRA, read_peft_adapter
from handler.model import Runner
from lorafarm.dev.adapters import random_prompts, write_dev_adapters
from lorafarm.dev.model import write_dev_model

t0 = time.time()
cache = Path(".cache/lorafarm")
model = cache / "devmodel-tiny-s0"
stamp = model / "lorafarm_devmodel.json"
if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": "tiny", "seed": 0}):
    write_dev_model(model, size="tiny", seed=0, force=True)
index = write_dev_adapters(model, cache / "canaries-tiny-s0", count=32, progress=False)
ok = True

def check(name, cond, detail=""):
    global ok
    ok &= bool(cond)
    print(f"  {'PASS' if cond else 'FAIL'} {name} {detail}")

ids = torch.randint(3, 400, (3, 33), generator=torch.Generator().manual_seed(0))
cpu = Runner(model, dtype=torch.float32, device="cpu")
gpu = Runner(model, dtype=torch.float32, device="cuda")
for r in (cpu, gpu):
    r.lora = ModelLoRA(r.config, {8: 2, 16: 2, 32: 2}, torch.float32, r.device)
ad = read_peft_adapter(cache / "canaries-tiny-s0" / "c0001")
for r in (cpu, gpu):
    r.lora.set_adapter(3, ad.weights, ad.rank, ad.alpha, ad.target_modules)
a = cpu.logits(ids, lora_slots=[3, 0, 3])
b = gpu.logits(ids, lora_slots=[3, 0, 3]).cpu()
err = ((a - b).abs().max() / a.abs().max()).item()
check("cuda runner == cpu runner (fp32, mixed adapter batch)", err <= 1e-4, f"rel err {err:.2e}")

from peft import PeftModel
from transformers import AutoModelForCausalLM
ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                      cache / "canaries-tiny-s0" / "c0001").merge_and_unload().eval()
with torch.no_grad():
    ref = ref_model(input_ids=ids[:1]).logits
err = ((b[:1] - ref).abs().max() / ref.abs().max()).item()
check("cuda unmerged == PEFT merge_and_unload (fp32)", err <= 1e-4, f"rel err {err:.2e}")

engine = Engine(model, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=64 << 20, max_batch=64,
                rank_pools={8: 11, 16: 11, 32: 10})
for name, info in index.items():
    engine.mount_adapter(name, cache / "canaries-tiny-s0" / info["path"], rank=info["rank"], alpha=info["alpha"],
                         target_modules=info["target_modules"])
texts, want = {}, {}
prompts = random_prompts(3, 300)
tok = engine.tokenizer
for i, p in enumerate(prompts):
    enc = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
    enc = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    name = sorted(index)[i % len(index)]
    want[f"r{i}"] = index[name]["marker"]
    engine.add_request(f"r{i}", enc, SamplingParams(max_tokens=12, temperature=0.0), name,
                       lambda ev: texts.__setitem__(ev.request_id, texts.get(ev.request_id, "") + ev.text))
while engine.step():
    pass
wrong = [k for k in want if texts.get(k) != want[k]]
check(f"cuda bf16 isolation: {len(want)} canary requests, own marker only", not wrong, f"wrong: {wrong[:5]}")
print(f"  ({time.time() - t0:.0f} s)")
sys.exit(0 if ok else 1)
EOF

echo "== 1b/2 OpenAI features on cuda: constrained rows (llguidance masks built on CPU, applied on"
echo "   the device) mixed with free rows, logprobs vs transformers + PEFT, seeded choices"
timeout 300 "$PY" -m pytest tests/handler/test_constrained.py -p no:cacheprovider -q

echo "== 2/2 benchmarks on cuda"
export LORAFARM_BENCH_DEVICE=cuda
timeout 600 "$PY" -m pytest benchmarks/bench_lora_layer.py benchmarks/bench_engine.py \
  --benchmark-only --benchmark-enable -p no:cacheprovider -q "$@"
echo "gpu_check: done; results in benchmarks/results/cuda-*.json and docs/benchmarks.md"
