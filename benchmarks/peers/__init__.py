"""`make bench-peers`: our farm beside vLLM, llama.cpp's server and `transformers serve` on the same
model and adapters, streamed over the OpenAI API (issue 22).

One concept per module: `install` (peers into var/peers/<peer>/ on demand), `adapters` (the seeded
adapter sets: W2-W5's and W6's), `convert` (model and PEFT adapters to GGUF for llama.cpp;
`lora_batch` runs its converter over many adapters in one process), `servers` (start on loopback,
wait ready, stop; threads and versions), `workloads` (W1-W6, W6 the Zipf mix; one streamed request,
one timed batch), `run` (the CLI: interleaved shuffled rounds, W6 in a phase of its own, raw CSVs,
greedy agreement, load per round), `report` (docs/peers.md and its plots from the CSVs, only when
asked).
"""

from pathlib import Path

PEERS_ROOT = Path("var/peers")
PEERS = ("ours", "vllm", "llamacpp", "transformers")
