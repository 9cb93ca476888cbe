"""The model room: what runs the base model and its adapters' arithmetic, and where K/V lives.

Owns the decoder (`runner`), the batched multi-LoRA layers and kernels (`lora`, `merge`), decode
attention (`paged_attention`), the paged KV cache and its block pool (`kvcache`, `prefix_cache`),
the CPU kernels in C (`small_gemm`, `decode_step`, csrc/) and small tensor helpers (`tensors`).
Tensors in, tensors out: no request, tenant or HTTP here.

May import: torch, transformers, safetensors, and modules of this room. Nothing else of handler/.
"""
