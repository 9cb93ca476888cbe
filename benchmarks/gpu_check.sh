#!/usr/bin/env bash
# The engine's GPU check, in one go (about 3-5 minutes on one modern GPU):
#   1. correctness on cuda: runner logits == the CPU runner and PEFT merge_and_unload() (float32),
#      and canary isolation through the engine in bfloat16 (300 requests over the 32 canaries); the
#      paged decode kernel's probe (checked against the gathered path, timed) and compiled decode
#      steps (CUDA graphs, mode "reduce-overhead") against eager;
#   2. the same benchmarks as on CPU (layer op at 7B dims on scattered slots, engine throughput vs
#      transformers + PEFT, admission, the 7B-shaped decode step in bfloat16 with 1/8/32 distinct
#      adapters on scattered slots and every LoRA kernel forced, one long row among short ones, and
#      ours vs `transformers serve --continuous-batching` over HTTP), written to var/bench/cuda-*.json
#      and rendered into docs/benchmarks.md (`python -m benchmarks.render_docs`);
#   3. vLLM multi-LoRA on the same 7B shapes (batch 32, 32 distinct rank-16 adapters vs none), if
#      `pip install vllm` succeeds there: var/bench/cuda-vllm.json (not rendered; compare by hand).
# Written without a GPU (none was available to its author): the first CUDA run may need fixes.
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

from handler.engine.engine import Engine, SamplingParams
from handler.model.lora import ModelLoRA, read_peft_adapter
from handler.model.runner import Runner
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

echo "== 1c/2 paged decode attention (Triton flex kernel) and compiled decode steps (CUDA graphs) on cuda"
timeout 600 "$PY" - <<'EOF'
import sys, time
from pathlib import Path

import torch

from handler.model import paged_attention
from handler.engine.engine import Engine, SamplingParams

ok = True
for dtype, shape in ((torch.float32, (4, 2, 32)), (torch.bfloat16, (32, 32, 128)), (torch.bfloat16, (32, 8, 128))):
    p = paged_attention.measure("cuda", dtype, *shape, 16, windows=(None, 4096), rows=32)  # checked and timed
    ok &= p.ok
    print(f"  {'PASS' if p.ok else 'FAIL'} paged kernel {dtype} heads/kv/D {shape}: {p.reason}; "
          f"paged {p.paged_ms:.3f} ms vs gathered {p.gathered_ms:.3f} ms at 32 rows")
model = Path(".cache/lorafarm/devmodel-tiny-s0")
out = {}
for compiled in (False, True):
    e = Engine(model, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=64 << 20, max_batch=32, rank_pools={16: 4},
               attention="paged", compile=compiled)
    got = {}
    for i in range(13):  # 13 rows: bucket 16, 3 padding rows
        e.add_request(f"r{i}", list(range(5 + i, 40 + 3 * i)), SamplingParams(max_tokens=24, temperature=0.0,
                      ignore_eos=True), None, lambda ev: got.setdefault(ev.request_id, []).append(ev.token_id))
    t0 = time.perf_counter()
    while e.step():
        pass
    out[compiled] = got
    print(f"  compile={compiled}: {time.perf_counter() - t0:.1f} s, compiled steps {e.runner.compiled_steps}")
same = out[True] == out[False]
ok &= same
print(f"  {'PASS' if same else 'FAIL'} compiled (reduce-overhead) decode == eager, bf16, 13 rows")
sys.exit(0 if ok else 1)
EOF

echo "== 1b/2 OpenAI features on cuda: constrained rows (llguidance masks built on CPU, applied on"
echo "   the device) mixed with free rows, logprobs vs transformers + PEFT, seeded choices"
timeout 300 "$PY" -m pytest tests/handler/test_constrained.py -p no:cacheprovider -q

echo "== 2/2 benchmarks on cuda"
export LORAFARM_BENCH_DEVICE=cuda
timeout 900 "$PY" -m pytest benchmarks/bench_lora_layer.py benchmarks/bench_engine.py benchmarks/bench_engine_7b.py \
  benchmarks/bench_serve.py --benchmark-only --benchmark-enable -p no:cacheprovider -q "$@"
"$PY" -m benchmarks.render_docs

echo "== 3/3 vLLM multi-LoRA on the 7B shapes (optional)"
if "$PY" -c 'import vllm' 2>/dev/null || "$PY" -m pip install -q vllm; then
  timeout 900 "$PY" - <<'EOF' || echo "gpu_check: vLLM comparison failed (see above)"
import json, random, shutil, tempfile, time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.bench_engine import _small_model
from benchmarks.bench_engine_7b import ALPHA, BATCH, MODULES, RANK, random_adapter, seven_b_shaped
from handler.model.runner import ModelConfig, load_hf_config
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

model = seven_b_shaped()
for f in list(_small_model().glob("tokenizer*")) + list(_small_model().glob("special_tokens_map.json")):
    shutil.copy(f, model / f.name)  # vLLM needs a tokenizer next to the weights
cfg = ModelConfig.from_hf(load_hf_config(model))
tmp = Path(tempfile.mkdtemp())
gen = torch.Generator().manual_seed(0)
for j in range(BATCH):
    d = tmp / f"a{j}"
    d.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in random_adapter(cfg, gen).items()}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA,
        "target_modules": MODULES, "base_model_name_or_path": str(model), "bias": "none"}))
llm = LLM(str(model), dtype="bfloat16", enable_lora=True, max_loras=BATCH, max_lora_rank=RANK, max_num_seqs=BATCH,
          max_model_len=512, gpu_memory_utilization=0.5)
prompts = [[random.Random(i).randrange(3, 400) for _ in range(64)] for i in range(BATCH)]
sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
out = {}
for label, loras in (("none", None), ("32", [LoRARequest(f"a{j}", j + 1, str(tmp / f"a{j}")) for j in range(BATCH)])):
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)
    out[label] = BATCH * 64 / (time.perf_counter() - t0)
out["ratio_32_over_none"] = out["32"] / out["none"]
Path("var/bench").mkdir(parents=True, exist_ok=True)
Path("var/bench/cuda-vllm.json").write_text(json.dumps(out, indent=1))
print("vLLM end-to-end tokens/s (64-token prompts, 64 new tokens):", out)
EOF
else
  echo "gpu_check: vllm does not install here; skipped"
fi
# issue 15: the embedding worker's encoder on the GPU against sentence-transformers' encode (same folder)
python - <<'EOF'
import tempfile, time, torch
from pathlib import Path
from sentence_transformers import SentenceTransformer
from handler.embed.model import Encoder
from lorafarm.dev.embedding import write_dev_embedding_model
folder = write_dev_embedding_model(Path(tempfile.mkdtemp()) / "e", size="small")
texts = [f"ticket {i}: where is my order " * (1 + i % 4) for i in range(32)]
st = SentenceTransformer(str(folder), device="cuda"); enc = Encoder(folder, device="cuda")
want = st.encode(texts, convert_to_tensor=True).float().cpu(); got = enc.embed_ids(enc.tokenize(texts))
print("embeddings on cuda: max |encoder - sentence-transformers| =", (got - want).abs().max().item())
for name, fn in (("encoder", lambda: enc.embed_ids(enc.tokenize(texts))), ("st", lambda: st.encode(texts, batch_size=32))):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(50): fn()
    torch.cuda.synchronize(); print(f"embeddings on cuda, {name}: {50 * 32 / (time.perf_counter() - t0):.0f} inputs/s at batch 32")
EOF
# issue 13: adapter loads on cuda. bench_adapter_load's StackEngine is on CPU; the CUDA form is the
# engine's mount (pinned slot image, non-blocking copy on a side stream) against a pinned H2D copy
python - <<'EOF'
import time, torch
from benchmarks.bench_adapter_load import BASE_CONFIG, MODULES, RANK, ALPHA, VALUES
from handler.adapters.cache import module_shapes
from handler.model.lora import ModelLoRA
from handler.model.runner import ModelConfig
cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                  num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=4096)
lora = ModelLoRA(cfg, {RANK: 1}, torch.bfloat16, torch.device("cuda"))
shapes = module_shapes(BASE_CONFIG); w = {}
for l in range(32):
    for m in MODULES:
        k, d = shapes[m]; p = f"base_model.model.model.layers.{l}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}"
        w[p + ".lora_A.weight"] = torch.randn(RANK, k).to(torch.bfloat16) * 0.01
        w[p + ".lora_B.weight"] = torch.randn(d, RANK).to(torch.bfloat16) * 0.01
img = lora.build_image(w, RANK, ALPHA, MODULES, pin_memory=True)
s = torch.cuda.Stream()
def mount():
    s.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(s):
        lora.write_image(1, img); e = torch.cuda.Event(); e.record(s)
    e.synchronize()
mount(); t0 = time.perf_counter()
for _ in range(20): mount()
ram = (time.perf_counter() - t0) / 20
src = torch.empty(VALUES, dtype=torch.bfloat16).pin_memory(); dst = torch.empty(VALUES, dtype=torch.bfloat16, device="cuda")
dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(20): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); h2d = (time.perf_counter() - t0) / 20
print(f"cuda RAM -> slot {ram * 1e3:.2f} ms, pinned H2D copy {h2d * 1e3:.2f} ms: RAM -> slot: {ram / h2d:.2f}x pinned H2D")
# disk -> slot on cuda: the saved slot image read through pinned staging straight into the slot, against
# a plain read of the same file into pinned memory plus one H2D copy
import os, tempfile
from pathlib import Path
from handler.adapters.cache import open_slot_image, save_slot_image
path = Path(tempfile.mkdtemp()) / "slot-image.safetensors"; save_slot_image(img, path)
def disk_mount():
    f_img = open_slot_image(path)
    s.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(s):
        lora.write_image(1, f_img); e = torch.cuda.Event(); e.record(s)
    e.synchronize()
def read_h2d():
    buf = torch.empty(path.stat().st_size, dtype=torch.uint8, pin_memory=True)
    with open(path, "rb", buffering=0) as f: f.readinto(memoryview(buf.numpy()))
    out = torch.empty(buf.numel(), dtype=torch.uint8, device="cuda"); out.copy_(buf, non_blocking=True); torch.cuda.synchronize()
for fn in (disk_mount, read_h2d): fn()
t0 = time.perf_counter(); [disk_mount() for _ in range(10)]; disk = (time.perf_counter() - t0) / 10
t0 = time.perf_counter(); [read_h2d() for _ in range(10)]; floor = (time.perf_counter() - t0) / 10
print(f"cuda disk -> slot {disk * 1e3:.2f} ms, read + pinned H2D {floor * 1e3:.2f} ms: disk -> slot: {disk / floor:.2f}x read+H2D")
EOF
# issue 16b: `lorafarm up --base` on a sharded bf16 checkpoint, replicas on cuda (bf16 by default there)
python -m pytest tests/e2e/test_real_base.py -q -p no:randomly && echo "gpu_check: lorafarm up --base on cuda: ok"
echo "gpu_check: done; results in var/bench/cuda-*.json and docs/benchmarks.md"
