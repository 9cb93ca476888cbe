"""`lorafarm devmodel` and `lorafarm devadapters`: offline fixtures for tests and the demo farm."""

from __future__ import annotations

import argparse


def _devmodel(args: argparse.Namespace) -> int:
    if args.kind == "embedding":
        from lorafarm.dev.embedding import write_dev_embedding_model

        out = write_dev_embedding_model(args.out, size=args.size, seed=args.seed, force=args.force)
    else:
        from lorafarm.dev.model import write_dev_model

        out = write_dev_model(args.out, size=args.size, seed=args.seed, force=args.force)
    print(out)
    return 0


def _devadapters(args: argparse.Namespace) -> int:
    from lorafarm.dev.adapters import write_dev_adapters

    index = write_dev_adapters(args.base, args.out, count=args.count, rank=args.rank)
    print(f"{len(index)} canary adapters in {args.out} (markers.json)")
    return 0


def register(sub) -> None:
    from lorafarm.dev.model import SIZES

    p = sub.add_parser("devmodel", help="write a small random Llama checkpoint (Hugging Face layout) "
                                          "or, with --kind embedding, a sentence-transformers encoder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--kind", default="chat", choices=["chat", "embedding"],
                   help="chat: a Llama decoder; embedding: a BERT encoder in the sentence-transformers layout")
    p.add_argument("--size", default="tiny", help=f"one of {', '.join(SIZES)} (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    p.set_defaults(func=_devmodel)

    p = sub.add_parser("devadapters", help="train canary LoRA adapters with PEFT on the dev model")
    p.add_argument("--base", required=True, help="dev model folder")
    p.add_argument("--out", required=True, help="output folder (cached: existing canaries are reused)")
    p.add_argument("--count", type=int, required=True, help="number of canaries")
    p.add_argument("--rank", type=int, default=None, help="one rank for all (default: 8/16/32 in turn)")
    p.set_defaults(func=_devadapters)
