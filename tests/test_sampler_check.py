"""scripts/sampler_check.py: the chi-square it judges a server's first-token
draws with, and a whole call against the built-in server (whose sampler is
exact: tests/test_sampling.py), on the tiny demo model."""

import json
import math
import random

import pytest

from scripts import sampler_check as sc


def _draw(probs: dict[int, float], n: int, rng: random.Random) -> dict[int, int]:
    ids, weights = zip(*probs.items())
    counts: dict[int, int] = {}
    for t in rng.choices(ids, weights, k=n):
        counts[t] = counts.get(t, 0) + 1
    return counts


def test_chi_square_accepts_exact_draws_and_rejects_a_biased_sampler():
    rng = random.Random(0)
    probs = {0: 0.5, 1: 0.2, 2: 0.1, 3: 0.05, 4: 0.001}  # the rest (0.149) is outside the reported head
    full = {**probs, 99: 1.0 - sum(probs.values())}
    _, dof, p_exact = sc.chi_square(_draw(full, 4000, rng), probs)
    assert dof == 4  # tokens 0-3 and the pooled rest (token 4 expects 4 draws: pooled too)
    assert p_exact > 0.01
    # A sampler that hands 3 % of the steps to a token outside the head: the head is thinner than reported.
    biased = dict(full)
    biased[0] -= 0.03
    biased[99] += 0.03
    _, _, p_biased = sc.chi_square(_draw(biased, 4000, rng), probs)
    assert p_biased < 1e-4


def test_poisson_z_is_zero_for_equal_rates_and_large_for_a_tenfold_excess():
    assert sc._z(10, 1000, 10, 1000) == 0.0
    assert sc._z(100, 10_000, 10, 10_000) > 8


def test_bins_cover_the_line():
    assert [sc._bin(x) for x in (-30.0, -18.0, -13.0, -9.0, -5.0, -0.1)] == list(range(6))


def test_a_call_against_the_built_in_server(generating_server, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(4)))
    out = tmp_path / "builtin.json"
    sc.main(["--url", generating_server, "--model-dir", tiny_model_dir, "--prompts", str(prompts),
             "--prompts-n", "4", "--n", "4", "--max-tokens", "12", "--draws", "512", "--per-request", "64",
             "--label", "builtin", "--out", str(out)])
    got = json.loads(out.read_text())
    ft, tl = got["first_token"], got["tail"]
    assert ft["draws"] == 512 and ft["dof"] >= 1
    # The built-in sampler is exact and seeded: the draws follow its reported head (a fixed outcome, not luck).
    assert ft["p_value"] > 1e-3, ft
    assert tl["samples"] == 16 and tl["tokens"] == sum(tl["bins"]) > 0
    assert math.isclose(sum(tl["per_1k"]), 1000.0, rel_tol=1e-9)
    assert 0.0 <= tl["reward_mean"] <= 1.0
    table = sc.compare([str(out), str(out)])
    assert "| reward (math), mean |" in table and "(z +0.0)" in table


def test_replies_are_scored_with_the_named_reward(generating_server, tiny_model_dir, tmp_path):
    # The recipe's reward is rollout.reward_fn's: the check must score with the function it names, not
    # a look-alike (a stricter answer check once read 0 where the recipe's reward read 0.04).
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "len.json"
    sc.main(["--url", generating_server, "--model-dir", tiny_model_dir, "--prompts", str(prompts), "--n", "4",
             "--max-tokens", "8", "--draws", "32", "--per-request", "32", "--out", str(out),
             "--reward", "tests.reward_fixtures:completion_length"])
    got = json.loads(out.read_text())
    assert got["reward"] == "tests.reward_fixtures:completion_length"
    assert got["tail"]["reward_mean"] > 0  # the tiny model's replies are a few characters long


def test_missing_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        sc.main(["--url", "http://127.0.0.1:1"])
    assert "--model-dir is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sc.main(["--model-dir", "m", "--prompts", "p.jsonl"])
    assert "--url or --launch is required" in capsys.readouterr().err


def test_launch_starts_and_stops_the_server_itself(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "launched.json"
    sc.main(["--launch", "builtin", "--device", "cpu", "--dtype", "float32", "--model-dir", tiny_model_dir,
             "--prompts", str(prompts), "--n", "2", "--max-tokens", "4", "--draws", "64", "--per-request", "32",
             "--log-dir", str(tmp_path / "logs"), "--startup-timeout-s", "300", "--out", str(out),
             "--also-unseeded", str(tmp_path / "unseeded.json")])
    got = json.loads(out.read_text())
    assert got["first_token"]["draws"] == 64 and got["tail"]["samples"] == 2 and got["seeded"]
    assert got["url"].startswith("http://127.0.0.1:")
    unseeded = json.loads((tmp_path / "unseeded.json").read_text())
    assert not unseeded["seeded"] and unseeded["label"].endswith("unseeded") and unseeded["tail"]["samples"] == 2
