from collections import Counter
from dataclasses import replace

import pytest

from loadtests.workload import (
    WorkloadSpec,
    add_workload_arguments,
    generate,
    read_trace,
    spec_from_options,
    system_prompt,
    workload_flags,
    workload_options,
    zipf_weights,
)


def test_same_seed_same_workload():
    models = [f"m{i}" for i in range(50)]
    assert generate(models, WorkloadSpec(seed=3)) == generate(models, WorkloadSpec(seed=3))
    assert generate(models, WorkloadSpec(seed=3)) != generate(models, WorkloadSpec(seed=4))


def test_skewed_mix_and_poisson_rate():
    models = [f"m{i}" for i in range(100)]
    items = generate(models, WorkloadSpec(rate=50, duration=100, seed=1))
    assert 4500 < len(items) < 5500  # Poisson: 5,000 expected, sd ~71
    counts = Counter(i.model for i in items)
    assert abs(counts["m0"] / len(items) - zipf_weights(100, 1.1)[0]) < 0.02
    assert counts["m0"] > 10 * counts.get("m50", 0)  # a few adapters carry most requests
    assert all(0 <= a.at < b.at < 100 for a, b in zip(items, items[1:]))
    assert all(1 <= i.max_tokens <= 64 for i in items)
    gaps = [b.at - a.at for a, b in zip(items, items[1:])]
    # exponential gaps: mean 1/rate and coefficient of variation 1 (a fixed pacing would give 0)
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(0.02, rel=0.05)
    assert sd / mean == pytest.approx(1.0, abs=0.1)


def test_zipf_exponent_controls_skew():
    assert zipf_weights(5000, 1.1)[0] > zipf_weights(5000, 0.8)[0]
    top250 = sum(zipf_weights(5000, 1.1)[:250])
    assert top250 == pytest.approx(0.76, abs=0.02)  # the figure: top 250 of 5,000 carry 76%


def test_lognormal_lengths_follow_their_medians():
    items = generate(["m"], WorkloadSpec(rate=100, duration=50, seed=2, prompt_words_median=20,
                                          max_tokens_median=30, max_tokens_cap=1000))  # fmt: skip
    words = sorted(len(i.prompt.split()) for i in items)
    outs = sorted(i.max_tokens for i in items)
    assert words[len(words) // 2] == pytest.approx(20, abs=2)
    assert outs[len(outs) // 2] == pytest.approx(30, abs=2)


def test_trace_replay_lengths_and_scaled_gaps(tmp_path):
    trace = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{s:02d}.000000,{10 + s},{5 + s}" for s in (0, 2, 4, 10)]
    trace.write_text("\n".join(rows) + "\n")
    parsed = read_trace(trace)
    assert [r.at for r in parsed] == [0, 2, 4, 10]
    items = generate(["a", "b"], WorkloadSpec(rate=1.0, duration=7.5), parsed)
    # mean gap of the trace is 10/3 s; scaled to 1 req/s: gaps 1, 0.6, 0.6, 1.8, then the trace again
    assert [round(i.at, 3) for i in items] == [1.0, 1.6, 2.2, 4.0, 5.0, 5.6, 6.2]
    assert [i.max_tokens for i in items] == [5, 7, 9, 15, 5, 7, 9]
    assert [len(i.prompt.split()) for i in items[:4]] == [10, 12, 14, 20]


def test_trace_without_the_columns_is_an_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        read_trace(bad)


def test_no_models_or_no_rate_is_an_error():
    with pytest.raises(ValueError):
        generate([], WorkloadSpec())
    with pytest.raises(ValueError):
        generate(["m"], WorkloadSpec(rate=0))


# -- shared system prompts (issue 24) ---------------------------------------------------------


def test_system_prompts_are_per_adapter_seeded_and_the_share_is_respected():
    models = [f"t/synth-{i:05d}:prod" for i in range(200)]
    spec = WorkloadSpec(rate=100, duration=40, seed=5, system_prompt_share=0.7)
    items = generate(models, spec)
    assert items == generate(models, spec)  # two runs replay identical traffic, system prompts included
    carrying = [i for i in items if i.system]
    assert len(carrying) / len(items) == pytest.approx(0.7, abs=0.03)  # ~4,000 requests: sd ~0.007
    by_model: dict[str, set[str]] = {}
    for i in carrying:
        by_model.setdefault(i.model, set()).add(i.system)
    assert all(len(texts) == 1 for texts in by_model.values())  # one system prompt per adapter (customer)
    texts = {next(iter(t)) for t in by_model.values()}
    assert len(texts) == len(by_model)  # and no two adapters share one
    assert all(i.system == system_prompt(i.model, spec) for i in carrying[:50])
    # a customer's system prompt is its own: other requests (another --seed) send the same text
    assert system_prompt(models[0], spec) == system_prompt(models[0], replace(spec, seed=6))
    other = generate(models, replace(spec, seed=6))
    assert {i.system for i in other if i.model == models[0] and i.system} == by_model[models[0]]
    assert system_prompt(models[0], spec) != system_prompt(models[0], replace(spec, system_prompt_seed=1))


def test_share_changes_nothing_but_the_system_prompts():
    """Arrivals, adapters, user prompts and lengths are the same at any share; share 0 is the
    workload as before (no system prompts)."""
    models = [f"m{i}" for i in range(50)]
    plain = generate(models, WorkloadSpec(seed=3))
    for share in (0.0, 0.5, 1.0):
        items = generate(models, WorkloadSpec(seed=3, system_prompt_share=share))
        assert [replace(i, system="") for i in items] == plain
        carrying = sum(1 for i in items if i.system)
        assert carrying == {0.0: 0, 1.0: len(items)}.get(share, carrying)
    assert all(i.system == "" for i in plain)


def test_system_prompt_lengths_follow_the_median_within_the_cap():
    spec = WorkloadSpec(seed=1, system_prompt_share=1.0, system_prompt_words_median=120,
                        system_prompt_words_sigma=0.8, system_prompt_words_cap=200)  # fmt: skip
    lengths = sorted(len(system_prompt(f"a{i}", spec).split()) for i in range(600))
    assert lengths[len(lengths) // 2] == pytest.approx(120, abs=12)
    assert 1 <= lengths[0] and lengths[-1] == 200  # sigma 0.8: some adapters hit the cap, none pass it
    tiny = replace(spec, system_prompt_words_median=1, system_prompt_words_sigma=0.0)
    assert len(system_prompt("a0", tiny).split()) == 1


def test_bad_system_prompt_options_are_errors():
    for bad in (dict(system_prompt_share=1.5), dict(system_prompt_share=-0.1), dict(system_prompt_words_median=0),
                dict(system_prompt_words_cap=0)):  # fmt: skip
        with pytest.raises(ValueError, match="system prompt"):
            generate(["m"], WorkloadSpec(**bad))


def test_workload_options_reach_the_locustfile_parser_unchanged():
    """`lorafarm loadtest` passes its workload options to the locustfile as flags (workload_flags);
    the locustfile parses them with the same WORKLOAD_OPTIONS and builds the same spec."""
    import argparse

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    ours = workload_options(parser.parse_args(["--system-prompt-share", "0.8", "--system-prompt-median", "150",
                                               "--system-prompt-sigma", "0.3", "--system-prompt-cap", "300",
                                               "--seed", "9", "--system-prompt-seed", "3"]))  # fmt: skip
    theirs = workload_options(parser.parse_args(workload_flags(ours)))
    assert theirs == ours
    spec = spec_from_options(theirs, 2.0, 10.0)
    assert (spec.system_prompt_share, spec.system_prompt_words_median, spec.system_prompt_words_sigma,
            spec.system_prompt_words_cap, spec.seed, spec.system_prompt_seed) == (0.8, 150, 0.3, 300, 9, 3)  # fmt: skip
    assert spec_from_options(workload_options(parser.parse_args([])), 1.0, 1.0).system_prompt_share == 0.0
