"""`lorafarm archive keygen|build|verify|inspect|basehash`: make and check signed adapter archives by hand."""

from __future__ import annotations

import argparse
import os

from lorafarm.errors import CliError  # tiny module: no heavy import at `lorafarm --help`


def _fail(e: Exception) -> CliError:
    return CliError(str(e))


def _keygen(args: argparse.Namespace) -> int:
    from archives.errors import ArchiveError
    from archives.keys import generate_keypair, key_id, load_public_keys

    try:
        private, public = generate_keypair(args.out, overwrite=args.force)
        kid = key_id(load_public_keys([public])[0])
    except ArchiveError as e:
        raise _fail(e) from None
    print(f"{private} (keep secret, mode 0600)\n{public} ({kid})")
    return 0


def _build(args: argparse.Namespace) -> int:
    from archives.basehash import base_model_hash, read_base_config
    from archives.build import build_archive
    from archives.errors import ArchiveError
    from archives.keys import load_private_key

    if not args.key:
        raise CliError("no signing key: pass --key private.pem or set LORAFARM_SIGNING_KEY")
    try:
        key = load_private_key(args.key)
        base_config = read_base_config(args.base)
        base_hash = base_model_hash(args.base, progress=True)
        manifest = build_archive(
            args.peft_dir, args.out, private_key=key, tenant_id=args.tenant, adapter_id=args.adapter_id,
            version=args.version, base_model_hash=base_hash, base_config=base_config, progress=True,
        )  # fmt: skip
    except ArchiveError as e:
        raise _fail(e) from None
    print(f"{manifest.adapter_id} {args.out} (rank {manifest.rank}, {', '.join(manifest.target_modules)})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from archives.basehash import base_model_hash, read_base_config
    from archives.errors import ArchiveError
    from archives.keys import load_public_keys
    from archives.reader import open_archive
    from archives.verify import verify_open_archive

    trust = args.trust or os.environ.get("LORAFARM_TRUST")
    if not trust:
        raise CliError("no trusted key: pass --trust public.pem or set LORAFARM_TRUST")
    try:
        keys = load_public_keys(trust)
        base_hash = base_config = None
        if args.base:
            base_config = read_base_config(args.base)
            base_hash = base_model_hash(args.base, progress=True)
        with open_archive(args.archive) as reader:
            verified = verify_open_archive(
                reader,
                keys,
                base_model_hash=base_hash,
                max_rank=args.max_rank,
                base_config=base_config,
                progress=True,
            )
    except ArchiveError as e:
        raise _fail(e) from None
    m = verified.manifest
    checked = "signature, checksums, tensors" + (", base" if args.base else "")
    print(
        f"OK {m.adapter_id} tenant={m.tenant_id} version={m.version} rank={m.rank} "
        f"signer={verified.signer} ({checked})"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from archives.errors import ArchiveError
    from archives.verify import read_manifest

    try:
        manifest = read_manifest(args.archive)
    except ArchiveError as e:
        raise _fail(e) from None
    print(json.dumps(json.loads(manifest.canonical_bytes()), indent=2, sort_keys=True))
    return 0


def _basehash(args: argparse.Namespace) -> int:
    from archives.basehash import base_model_hash, write_trained_base
    from archives.errors import ArchiveError

    try:
        value = base_model_hash(args.base_dir, progress=True)
        if args.write:
            if not os.path.isfile(os.path.join(args.write, "adapter_config.json")):
                raise CliError(f"--write {args.write}: not a PEFT adapter folder (no adapter_config.json)")
            write_trained_base(args.write, value)
    except ArchiveError as e:
        raise _fail(e) from None
    print(value)
    return 0


def register(sub) -> None:
    p = sub.add_parser("archive", help="build, sign, verify and inspect adapter archives (.lar)")
    archive = p.add_subparsers(dest="archive_command", metavar="ACTION", parser_class=type(p))
    archive.required = True

    k = archive.add_parser("keygen", help="write an Ed25519 key pair (private.pem 0600, public.pem)")
    k.add_argument("--out", required=True, help="folder for private.pem and public.pem")
    k.add_argument("--force", action="store_true", help="replace an existing key pair")
    k.set_defaults(func=_keygen)

    b = archive.add_parser("build", help="validate a PEFT adapter folder and write a signed archive")
    b.add_argument(
        "peft_dir", metavar="PEFT_DIR", help="folder with adapter_config.json and adapter_model.safetensors"
    )
    b.add_argument("--base", required=True, help="base model folder (config.json, *.safetensors)")
    b.add_argument(
        "--key",
        default=os.environ.get("LORAFARM_SIGNING_KEY"),
        help="Ed25519 private key (PEM); default $LORAFARM_SIGNING_KEY",
    )
    b.add_argument("--tenant", required=True, help="tenant id (slug)")
    b.add_argument("--out", required=True, help="archive to write (FILE.lar)")
    b.add_argument("--adapter-id", default=None, help="default: ad- + sha256(tenant, content checksum)[:20]")
    b.add_argument("--version", type=int, default=1, help="adapter version (default 1)")
    b.set_defaults(func=_build)

    v = archive.add_parser(
        "verify", help="check signature, checksums, tensors and (with --base) the base hash"
    )
    v.add_argument("archive", metavar="FILE.lar")
    v.add_argument(
        "--trust",
        action="append",
        default=None,
        help="trusted public key (PEM); repeatable; default $LORAFARM_TRUST (':'-separated)",
    )
    v.add_argument("--base", default=None, help="base model folder: also check the base hash and shapes")
    v.add_argument("--max-rank", type=int, default=None, help="refuse ranks above this")
    v.set_defaults(func=_verify)

    h = archive.add_parser("basehash", help="print the base-model hash a training job sends with an upload")
    h.add_argument("base_dir", metavar="DIR", help="base model folder (*.safetensors)")
    h.add_argument("--write", default=None, metavar="PEFT_DIR",
                   help="also record it beside this adapter (base_model_hash.txt), where uploads read it")
    h.set_defaults(func=_basehash)

    i = archive.add_parser("inspect", help="print the manifest (signature NOT checked; use verify)")
    i.add_argument("archive", metavar="FILE.lar")
    i.set_defaults(func=_inspect)
