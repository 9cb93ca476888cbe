"""Signed adapter archives (`.lar`) and the object store that holds them.

A `.lar` is an uncompressed tar of exactly four files: manifest.json (canonical JSON, see
manifest.py), manifest.sig (raw Ed25519 signature over those bytes), adapter_config.json and
adapter_model.safetensors (PEFT layout). The registry builds and signs them (build.py); replicas
verify before trusting (verify.py) and extract through a member allowlist (extract.py).

Modules, one concept each: errors, ids, digest, basehash, safetensors_header, manifest, keys,
peft_dir, reader, build, verify, extract, fsutil, limits, store (local folder and S3), cli.
The cross-package API is pinned in docs/contracts.md ("archives").
"""
