"""The batched logits processing of `handler.engine.sampling`: each stage against a per-row reference,
each penalty and bias changes what is sampled, filters keep what they promise, rows are independent."""

from __future__ import annotations

import torch

from handler.engine.sampling import RowState, SamplingParams, sample

V = 50
CPU = torch.device("cpu")


def states(params, prompts=None):
    return [RowState(p, (prompts or [[1, 2]] * len(params))[i], CPU, V) for i, p in enumerate(params)]


def run(logits, params, prompts=None, history=None):
    """Sample once after feeding each row its `history` of output tokens."""
    st = states(params, prompts)
    for s, h in zip(st, history or [[] for _ in params]):
        for t in h:
            s.accept(t)
    return sample(logits.clone(), params, st), st


def reference_logits(row: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The math of the module doc, one row, plain Python."""
    x = row.clone()
    seen = set(prompt) | set(out)
    for t in range(V):
        if p.repetition_penalty != 1.0 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = out.count(t)
        x[t] -= c * p.frequency_penalty + (1.0 if c else 0.0) * p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    return x


def test_processing_matches_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, V) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 7: -2.0}),
        SamplingParams(temperature=0.0, presence_penalty=-0.5, repetition_penalty=0.7, logit_bias={0: 1.0}),
    ]
    prompts = [[1, 2], [4, 4, 9], [int(logits[2].argmax()), 5], [1], [8, 9]]
    history = [[], [int(logits[1].argmax())] * 2 + [3], [6, 6], [], [int(logits[4].argmax()), 2]]
    tokens, _ = run(logits, params, prompts, history)
    for i, p in enumerate(params):
        assert tokens[i] == int(reference_logits(logits[i], p, prompts[i], history[i]).argmax()), i


def test_each_penalty_and_bias_changes_the_choice():
    """Each stage, alone, moves greedy off the raw argmax (so ignoring it would fail)."""
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 2.0, 1.5  # 10 wins, 11 is the runner-up
    free, _ = run(logits, [SamplingParams(temperature=0.0)], history=[[10]])
    assert free == [10]
    cases = [
        (SamplingParams(temperature=0.0, presence_penalty=1.0), [[1, 2]], [[10]]),
        (SamplingParams(temperature=0.0, frequency_penalty=0.3), [[1, 2]], [[10, 10]]),  # 0.6 > 0.5
        (SamplingParams(temperature=0.0, repetition_penalty=1.5), [[10]], [[]]),  # prompt tokens count
        (SamplingParams(temperature=0.0, logit_bias={11: 1.0}), [[1, 2]], [[]]),
        (SamplingParams(temperature=0.0, logit_bias={10: -100.0}), [[1, 2]], [[]]),
    ]
    for p, prompt, hist in cases:
        got, _ = run(logits, [p], prompt, hist)
        assert got == [11], p
    # frequency scales with the count: one occurrence (0.3) is not enough
    got, _ = run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.3)], history=[[10]])
    assert got == [10]


def draws(logits, p: SamplingParams, n=300):
    seen = set()
    for seed in range(n):
        t, _ = run(logits, [SamplingParams(**{**p.__dict__, "seed": seed})])
        seen.add(t[0])
    return seen


def test_top_k_top_p_min_p_keep_only_what_they_promise():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05] + [1e-9] * (V - 5)]))
    assert draws(logits, SamplingParams(temperature=1.0)) >= {0, 1, 2, 3}
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, top_k=1)) == {0}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.6)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}  # 0.15 < 0.5 * 0.4
    assert draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.9)) == {0, 1, 2}


def test_rows_are_independent_of_their_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    mixed = [SamplingParams(temperature=0.9, seed=5, top_k=7), SamplingParams(temperature=0.0, presence_penalty=2.0),
             SamplingParams(temperature=1.2, seed=9, min_p=0.1, logit_bias={4: 3.0}),
             SamplingParams(temperature=0.7, seed=2, repetition_penalty=1.3)]
    together = [[], [], [], []]
    st = states(mixed)
    alone = [states([p]) for p in mixed]
    for step in range(8):
        x = torch.randn(4, V, generator=torch.Generator().manual_seed(step))
        for i, t in enumerate(sample(x, mixed, st)):
            together[i].append(t)
        for i in range(4):
            assert sample(x[i : i + 1], [mixed[i]], alone[i]) == [together[i][-1]]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, seed=1, logprobs=0,
                                                                           presence_penalty=1.0),
              SamplingParams(temperature=0.0)]
    tokens, st = run(logits, params)
    ref = torch.log_softmax(logits, dim=-1)
    lp, top = st[0].logprobs
    assert abs(lp - ref[0, tokens[0]].item()) < 1e-6 and [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert all(abs(v - ref[0, t].item()) < 1e-6 for t, v in top)
    lp1, top1 = st[1].logprobs
    assert abs(lp1 - ref[1, tokens[1]].item()) < 1e-6 and top1 == []
    assert st[2].logprobs is None
