"""``n`` completions per prompt (issue 25, item 3): ``generate(n=...)`` and ``--n`` decode each
prompt ``n`` times with seeds derived from the prompt's seed (``completion_seed``), prompt after
prompt; completion ``j`` is exactly what a request seeded ``completion_seed(seed, j)`` gives
alone, whatever the pipeline batches it with."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import parse_one_object, run_cli
from test_overlap import engine

from speculum.runtime import checks
from speculum.runtime.generate import completion_seed, generate

PROMPTS = [[1, 2, 3], [5], [9, 4, 12, 0, 7]]
SAMPLED = {"temperature": 1.0, "top_k": 6, "max_new_tokens": 10}


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(checks.INT64_MIN, checks.INT64_MAX), n=st.integers(2, 40))
def test_completion_seeds_are_distinct_int64_seeds_and_the_first_is_the_seed(seed, n):
    seeds = [completion_seed(seed, index) for index in range(n)]
    assert seeds[0] == seed and len(set(seeds[1:])) == n - 1
    assert all(checks.INT64_MIN <= s <= checks.INT64_MAX for s in seeds)
    assert seeds == [completion_seed(seed, index) for index in range(n)]  # deterministic


@pytest.mark.parametrize("name", ["plain", "eagle tree", "eagle3 sampled drafts"])
def test_each_completion_is_the_request_its_derived_seed_makes(name):
    built = engine(name, False)
    results = generate(PROMPTS, engine=built, seed=7, n=3, **SAMPLED)
    assert len(results) == 3 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        for j in range(3):
            alone = {"prompt_ids": prompt, "seed": completion_seed(7, j)}
            (expected,) = generate([alone], engine=built, **SAMPLED)
            assert results[3 * i + j].token_ids == expected.token_ids, (i, j)
    # Sampled completions of one prompt differ (the target is peaked: over all prompts).
    assert len({r.token_ids for r in results}) > len(PROMPTS)
    first = generate(PROMPTS, engine=built, seed=7, **SAMPLED)
    assert [r.token_ids for r in results[::3]] == [r.token_ids for r in first]


def test_n_below_one_is_refused():
    for n, error in [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match=rf"n={n!r}: must be an integer >= 1"):
            generate(PROMPTS, engine=engine("plain", False), n=n)


def test_the_command_line_takes_n(capsys, tmp_path):
    common = ["--prompt-ids", "1,2,3", "--algorithm", "plain", "--max-new-tokens", "8"]
    sampled = ["--temperature", "1.0", "--seed", "3", "--n", "3"]
    status, out, _ = run_cli(capsys, *common, *sampled, "--json")
    completions = parse_one_object(out)["completions"]
    expected = generate(
        [[1, 2, 3]], algorithm="plain", max_new_tokens=8, temperature=1.0, seed=3, n=3
    )
    assert status == 0 and [c["token_ids"] for c in completions] == [
        list(r.token_ids) for r in expected
    ]
    assert all({"text", "finish_reason", "stats"} <= set(c) for c in completions)
    status, out, _ = run_cli(capsys, *common, *sampled)
    assert status == 0 and out.count("=== completion ") == 3
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]))
    status, out, _ = run_cli(capsys, "--prompts-file", str(prompts), *common[2:], *sampled)
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 0 and [(x["prompt_index"], x["completion"]) for x in lines] == [
        (i, j) for i in range(2) for j in range(3)
    ]
    status, out, err = run_cli(capsys, *common, "--n", "0")
    assert status == 2 and out == "" and "--n takes an integer >= 1" in err
    status, _, err = run_cli(capsys, "--prompt-ids", "1,2", "--n", "2", "--compare-plain")
    assert status == 2 and "--compare-plain times one completion" in err
