"""`lorafarm archive keygen|build|verify|inspect` end to end, in process."""

from __future__ import annotations

import json
import shutil
import stat

import pytest

from lorafarm.cli import main


@pytest.fixture
def keydir(tmp_path, capsys):
    assert main(["archive", "keygen", "--out", str(tmp_path / "keys")]) == 0
    capsys.readouterr()
    return tmp_path / "keys"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_keygen(keydir, capsys):
    assert stat.S_IMODE((keydir / "private.pem").stat().st_mode) == 0o600
    assert (keydir / "public.pem").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert main(["archive", "keygen", "--out", str(keydir)]) == 2
    assert "already exists" in _one_error_line(capsys)


def test_build_verify_inspect(keydir, canary_dir, dev_model, dev_model_b, tmp_path, capsys):
    lar = tmp_path / "c.lar"
    build = ["archive", "build", str(canary_dir), "--base", str(dev_model), "--key", str(keydir / "private.pem"),
             "--tenant", "acme", "--out", str(lar), "--version", "4"]  # fmt: skip
    assert main(build) == 0
    adapter_id = capsys.readouterr().out.split()[0]
    assert adapter_id.startswith("ad-")

    assert (
        main(["archive", "verify", str(lar), "--trust", str(keydir / "public.pem"), "--base", str(dev_model)])
        == 0
    )
    assert capsys.readouterr().out.startswith(f"OK {adapter_id}")

    assert main(["archive", "inspect", str(lar)]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert (manifest["adapter_id"], manifest["version"], manifest["tenant_id"]) == (adapter_id, 4, "acme")

    # another base: refused, one line, exit 2
    assert (
        main(
            ["archive", "verify", str(lar), "--trust", str(keydir / "public.pem"), "--base", str(dev_model_b)]
        )
        == 2
    )
    assert "built for base" in _one_error_line(capsys)

    # an untrusted key among several trusted ones is still refused; the right one among them passes
    main(["archive", "keygen", "--out", str(tmp_path / "other")])
    capsys.readouterr()
    assert main(["archive", "verify", str(lar), "--trust", str(tmp_path / "other" / "public.pem")]) == 2
    assert "trusted key" in _one_error_line(capsys)
    trust_both = ["--trust", str(tmp_path / "other" / "public.pem"), "--trust", str(keydir / "public.pem")]
    assert main(["archive", "verify", str(lar), *trust_both]) == 0
    capsys.readouterr()

    # a flipped byte
    import tarfile

    with tarfile.open(lar) as tar:
        weights_at = tar.getmember("adapter_model.safetensors").offset_data
    data = bytearray(lar.read_bytes())
    data[weights_at + 5000] ^= 0xFF
    bad = tmp_path / "bad.lar"
    bad.write_bytes(bytes(data))
    assert main(["archive", "verify", str(bad), "--trust", str(keydir / "public.pem")]) == 2
    assert "sha256" in _one_error_line(capsys)


def test_build_refuses_pickle(keydir, canary_dir, dev_model, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    adapter = tmp_path / "adapter"
    shutil.copytree(canary_dir, adapter)
    torch.save(load_file(adapter / "adapter_model.safetensors"), adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    out = tmp_path / "x.lar"
    argv = ["archive", "build", str(adapter), "--base", str(dev_model), "--key", str(keydir / "private.pem"),
            "--tenant", "acme", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    assert "pickle weights are refused" in _one_error_line(capsys)
    assert not out.exists()


def test_inspect_garbage(tmp_path, capsys):
    junk = tmp_path / "junk.lar"
    junk.write_bytes(b"hello" * 100)
    assert main(["archive", "inspect", str(junk)]) == 2
    assert "not a readable tar" in _one_error_line(capsys)


def test_trust_and_key_from_environment(keydir, canary_dir, dev_model, tmp_path, capsys, monkeypatch):
    lar = tmp_path / "c.lar"
    monkeypatch.setenv("LORAFARM_SIGNING_KEY", str(keydir / "private.pem"))
    # parsers read their defaults when built, i.e. inside main(): the env applies
    build = [
        "archive",
        "build",
        str(canary_dir),
        "--base",
        str(dev_model),
        "--tenant",
        "acme",
        "--out",
        str(lar),
    ]
    assert main(build) == 0
    monkeypatch.delenv("LORAFARM_TRUST", raising=False)
    assert main(["archive", "verify", str(lar)]) == 2
    assert "no trusted key" in _one_error_line(capsys)
    monkeypatch.setenv("LORAFARM_TRUST", f"{tmp_path / 'missing.pem'}:{keydir / 'public.pem'}")
    assert main(["archive", "verify", str(lar)]) == 2  # an unreadable trust file is an error, not skipped
    assert "missing.pem" in _one_error_line(capsys)
    monkeypatch.setenv("LORAFARM_TRUST", str(keydir / "public.pem"))
    assert main(["archive", "verify", str(lar)]) == 0
