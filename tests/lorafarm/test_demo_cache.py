"""`lorafarm demo` without --state-dir: the dev model and the demo canaries are made once in the user
cache ($LORAFARM_CACHE_DIR/demo) and the next run, in a new temporary state dir, reuses them without
training again (issue 25: every run retrained them for minutes). Training is a counting stub and the
farm stops right after preparing, so this takes seconds; real canary training and the canaries'
answers are covered by tests/lorafarm/test_devadapters.py and the e2e tests."""

from __future__ import annotations

import pytest


class _Prepared(Exception):
    """Raised by the stub farm once `prepare()` has run: nothing is started."""


def test_demo_trains_once_then_reuses_the_user_cache(tmp_path, monkeypatch):
    import lorafarm.dev.adapters as dev_adapters
    import lorafarm.farm as farm_mod
    from lorafarm.cli import build_parser
    from lorafarm.farm_cli import _demo

    monkeypatch.setenv("LORAFARM_CACHE_DIR", str(tmp_path / "cache"))
    trained: list[str] = []

    def fake_train(base_model, tokenizer, spec, out, **kw):
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_model.safetensors").write_bytes(b"stub")
        trained.append(out.name)

    monkeypatch.setattr(dev_adapters, "train_canary", fake_train)
    monkeypatch.setattr(dev_adapters, "_load_base", lambda base: (None, None))
    runs: list = []

    class PrepareOnly(farm_mod.Farm):
        def up(self):
            runs.append(self)
            self.prepare()
            raise _Prepared

    monkeypatch.setattr(farm_mod, "Farm", PrepareOnly)
    args = build_parser().parse_args(["demo"])
    assets = tmp_path / "cache" / "demo"

    with pytest.raises(_Prepared):
        _demo(args)
    first = runs[0]
    assert first.assets_dir == assets and not first.state_dir.exists()  # a temporary state dir, removed
    count = first.demo_adapters
    assert count >= 1 and sorted(trained) == [f"c{i:04d}" for i in range(count)]
    model = first.model_dir / "model.safetensors"
    assert model.is_file() and model.is_relative_to(assets)
    assert (first.adapters_dir / "markers.json").is_file() and first.adapters_dir.is_relative_to(assets)
    stamp = model.stat().st_mtime_ns

    with pytest.raises(_Prepared):
        _demo(args)
    second = runs[1]
    assert second.state_dir != first.state_dir and second.assets_dir == assets
    assert len(trained) == count  # nothing trained again
    assert model.stat().st_mtime_ns == stamp  # nor the dev model written again
