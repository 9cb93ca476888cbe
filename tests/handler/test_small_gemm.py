"""handler/model/small_gemm.py: the small-M CPU kernel equals F.linear, gives a row the same bits whatever
rows share the call, and falls back to F.linear outside its domain or when it cannot be built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from handler.model import small_gemm

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="small-M kernel not built here (no cc or AVX2)")


@pytest.mark.parametrize("k", [576, 1536, 13, 8, 1])  # multiples of 8 and a scalar tail
@pytest.mark.parametrize("d", [1, 3, 64, 577])  # fewer rows than a thread's share, odd counts
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear(k, d, threads, monkeypatch):
    monkeypatch.setattr(small_gemm, "PARALLEL_MIN", 0)  # threads on every product, even these small ones
    g = torch.Generator().manual_seed(k * 1000 + d)
    w, b = torch.randn(d, k, generator=g), torch.randn(d, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in range(1, small_gemm.MAX_ROWS + 1):
            x = torch.randn(m, k, generator=g)
            assert small_gemm.applies(x, w)
            torch.testing.assert_close(small_gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5 * k**0.5)
            torch.testing.assert_close(small_gemm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("parallel_min", [0, small_gemm.PARALLEL_MIN])
def test_a_row_has_the_same_bits_alone_or_beside_others_on_any_thread_count(parallel_min, monkeypatch):
    monkeypatch.setattr(small_gemm, "PARALLEL_MIN", parallel_min)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3075, 579, generator=g)  # rows left over after every block size, and a k tail
    rows = torch.randn(small_gemm.MAX_ROWS, 579, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([small_gemm.linear(rows[i : i + 1], w) for i in range(len(rows))])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(2, small_gemm.MAX_ROWS + 1):
                together = small_gemm.linear(rows[:m].contiguous(), w)
                assert torch.equal(together, alone[:m]), (threads, m)
            # the row in another position, beside other rows
            assert torch.equal(small_gemm.linear(rows.flip(0).contiguous(), w), alone.flip(0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", ["too many rows", "bfloat16", "non-contiguous x", "transposed w", "3-d x", "grad"])
def test_outside_its_domain_it_is_f_linear(case):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 64, generator=g), torch.randn(32, 64, generator=g)
    if case == "too many rows":
        x = torch.randn(small_gemm.MAX_ROWS + 1, 64, generator=g)
    elif case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "non-contiguous x":
        x = torch.randn(64, 4, generator=g).T
    elif case == "transposed w":
        w = torch.randn(64, 32, generator=g).T
    elif case == "3-d x":
        x = torch.randn(2, 4, 64, generator=g)
    else:
        w.requires_grad_(True)
    assert not small_gemm.applies(x, w)
    assert torch.equal(small_gemm.linear(x, w), F.linear(x, w))


def test_disabled_or_unbuildable_falls_back_with_a_warning(tmp_path):
    """LORAFARM_SMALL_GEMM=0: never loaded. A compiler that fails: one warning, then F.linear."""
    code = (
        "import logging, torch, torch.nn.functional as F\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from handler.model import small_gemm\n"
        "x, w = torch.randn(2, 16), torch.randn(8, 16)\n"
        "assert torch.equal(small_gemm.linear(x, w), F.linear(x, w))\n"
        "print('available', small_gemm.available())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LORAFARM_KERNEL_DIR": str(tmp_path / "k")}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "LORAFARM_SMALL_GEMM": "0"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr
    assert "available False" in off.stdout and not (tmp_path / "k").exists()
    bad_cc = tmp_path / "cc"
    bad_cc.write_text("#!/bin/sh\necho 'cc: error: simulated' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    broken = subprocess.run([sys.executable, "-c", code], env={**env, "CC": str(bad_cc)},
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode == 0, broken.stderr
    assert "available False" in broken.stdout
    assert "CPU decode kernels unavailable" in broken.stderr and "simulated" in broken.stderr
    assert not list((tmp_path / "k").glob("*.so")) and not list((tmp_path / "k").glob(".lorafarm_kernels-*"))


def test_built_once_and_reused(tmp_path):
    first = small_gemm.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert small_gemm.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
