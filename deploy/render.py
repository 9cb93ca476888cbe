"""Render a kustomization without kustomize: `python deploy/render.py deploy/overlays/gpu`.

For machines without kubectl (`kubectl kustomize` is the reference; tests check both agree where
kubectl exists). Supports what deploy/ uses and nothing more: `resources` (files and folders),
`namespace`, `labels` (pairs, metadata only), `images` (newName/newTag) and `patches` with a `target`
(kind, name) and an inline JSON 6902 patch. Output: the YAML documents, `---`-separated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jsonpatch
import yaml

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}


def _images(obj, images: list[dict]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "image" and isinstance(v, str):
                name, _, tag = v.partition(":")
                for im in images:
                    if im["name"] == name:
                        obj[k] = f"{im.get('newName', name)}:{im.get('newTag', tag or 'latest')}"
            else:
                _images(v, images)
    elif isinstance(obj, list):
        for v in obj:
            _images(v, images)


def render(root: str | Path) -> list[dict]:
    root = Path(root)
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for res in k.get("resources", []):
        p = root / res
        if p.is_dir():
            docs += render(p)
        else:
            docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    for d in docs:
        meta = d.setdefault("metadata", {})
        if k.get("namespace") and d["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        for lab in k.get("labels", []):
            meta.setdefault("labels", {}).update(lab["pairs"])
        _images(d, k.get("images", []))
    for patch in k.get("patches", []):
        t = patch["target"]
        ops = yaml.safe_load(patch["patch"])
        for i, d in enumerate(docs):
            if d["kind"] == t.get("kind", d["kind"]) and d["metadata"]["name"] == t.get("name", d["metadata"]["name"]):
                docs[i] = jsonpatch.apply_patch(d, ops)
    return docs


if __name__ == "__main__":
    print(yaml.safe_dump_all(render(sys.argv[1]), sort_keys=False), end="")
