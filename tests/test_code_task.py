"""The code-completion task of issue 52's GRPO run: the ``code_complete``
reward (torchtitan_grpo/rollout/code_task.py), the dataset builder
(scripts/make_code_dataset.py) on a tiny folder, and a short GRPO run of
train_configs/moe_code_grpo.toml on CPU (a tiny random Qwen3-MoE with the
byte tokenizer, router replay on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_e2e import _env, _metrics, _servers_alive

sys.path.insert(0, ROOT)

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

from scripts import make_code_dataset, pretrain_moe  # noqa: E402
from torchtitan_grpo.rollout import rewards  # noqa: E402
from torchtitan_grpo.rollout.code_task import code_complete, function_rows, function_text  # noqa: E402

CONFIG = os.path.join(ROOT, "train_configs", "moe_code_grpo.toml")
HEAD = 'def add(a, b):\n    """Return the sum of a and b."""\n'
METHOD = ('class Box:\n    def __init__(self, items):\n        self.items = items\n\n'
          '    def size(self):\n        """How many items the box holds."""\n')


def _score(completion: str, head: str = HEAD, prompt: str | None = None, **row) -> float:
    return code_complete(head if prompt is None else prompt, completion, {"head": head, **row})


# --------------------------------------------------------------------------
# The reward
# --------------------------------------------------------------------------


def test_a_finished_function_that_parses_scores_one():
    assert _score("    return a + b\n\ndef sub(a, b):") == 1.0
    assert _score("    total = a + b\n    return total\n") == 1.0  # the text ends after a whole line
    method = METHOD.split("    def size")[1]
    assert _score("        return len(self.items)\n\n    def clear(self):", head="    def size" + method,
                  prompt=METHOD) == 1.0


def test_a_syntax_error_scores_zero():
    assert _score("    return a +\n\ndef sub(a, b):") == 0.0
    assert _score("    return (a + b\n\nx = 1\n") == 0.0
    assert _score("  return a\n    return b\n\ndef f():") == 0.0  # inconsistent indentation


@pytest.mark.parametrize("body", ["    pass\n", "    ...\n", '    """More words."""\n',
                                  "    raise NotImplementedError\n", "    raise NotImplementedError('todo')\n",
                                  "    pass\n    ...\n", "", "    return None\n", "    x = 0\n    return x\n"])
def test_a_body_that_does_nothing_or_ignores_its_arguments_scores_zero(body):
    assert _score(body + "\ndef sub(a, b):") == 0.0


@pytest.mark.parametrize("body", ["    return a\n", "    return b\n", '    """Done."""\n    return a\n'])
def test_a_body_that_hands_back_an_argument_scores_zero(body):
    assert _score(body + "\ndef sub(a, b):") == 0.0
    method = METHOD.split("    def size")[1]
    assert _score("        return self\n", head="    def size" + method, prompt=METHOD) == 0.0


def test_a_body_far_smaller_than_the_reference_scores_zero():
    reference = ("    total = 0\n    for x in (a, b):\n        if x is not None:\n            total += x\n"
                 "    return total\n")
    assert _score(reference, answer=reference) == 1.0
    assert _score("    return a + b\n", answer=reference) == 0.0  # 7 ast nodes against the reference's 28
    assert _score("    return a + b\n", answer="    return b + a\n") == 1.0


def test_a_function_without_arguments_needs_no_argument_read():
    assert _score("    return 42\n", head='def answer():\n    """The answer."""\n') == 1.0


def test_a_completion_that_runs_past_the_function_is_cut_at_the_dedent():
    """The text from the first line back at the def's indentation is not
    scored, however broken; a completion that never gets there and stops
    mid-line was cut by the token budget."""
    assert _score("    return a + b\n\n\nclass (((:\n  garbage") == 1.0
    assert _score("    return a + b\n# a comment at column 0 ends it too\n)))") == 1.0
    assert function_text("    x = 1\n    return x\nnext_thing\n", indent=0) == "    x = 1\n    return x\n"
    assert function_text("    return a + b\n    # more", indent=0) is None
    assert _score("    return a + b\n    # more") == 0.0
    assert _score("    return a + b") == 0.0  # the budget ended the line: unfinished


def test_names_must_be_defined_somewhere_the_function_can_see():
    assert _score("    return frobnicate(a, b)\n") == 0.0
    assert _score("    return frobnicate(a, b)\n", names="frobnicate other") == 1.0  # module names
    assert _score("    return frobnicate(a, b)\n", prompt="from lib import frobnicate\n\n" + HEAD) == 1.0
    assert _score("    return len([a, b]) + sum(x for x in (a, b))\n") == 1.0  # builtins, locals
    assert _score("    import math\n    c = math.hypot(a, b)\n    return c\n") == 1.0
    assert _score("    return self.value\n") == 0.0  # add() has no self


def test_nothing_of_the_completion_runs(tmp_path):
    marker = tmp_path / "ran"
    body = f"    import os\n    os.system('touch {marker}')\n    return a + b\n"
    assert _score(body) == 1.0 and not marker.exists()


def test_registered_as_a_builtin_and_a_row_without_head_scores_zero_through_score_all():
    assert rewards.load_reward_fn("code_complete") is code_complete
    with pytest.raises(KeyError, match="no 'head'"):
        code_complete("x", "    return 1\n", {"prompt": "x"})
    assert rewards.score_all(code_complete, [("x", "    return 1\n", {"prompt": "x"})]) == [0.0]


# --------------------------------------------------------------------------
# Rows and the dataset builder
# --------------------------------------------------------------------------

MODULE = '''"""A module."""
import os

LIMIT = 3


def short(path):
    """The last part of a path."""
    return os.path.basename(path)


def long_body(x):
    """Too long a body for the limit."""
    values = [x, x + 1, x + 2, x + 3, x + 4, x + 5, x + 6, x + 7, x + 8, x + 9, x + 10, x + 11]
    return values


def no_docstring(x):
    return x


def uses_unknown(x):
    """Reads a name nobody defines: its reference fails the check."""
    return mystery(x)


class Counter:
    """Counts."""

    def __init__(self):
        self.n = 0

    @property
    def value(self):
        """The count, capped at LIMIT."""
        return min(self.n, LIMIT)

    def stub(self):
        """Not written yet."""
        raise NotImplementedError
'''


def test_rows_of_a_module():
    rows = function_rows(MODULE, "pkg/mod.py", context_bytes=40, max_prompt_bytes=200, max_body_bytes=60)
    assert [r["id"] for r in rows] == ["pkg/mod.py:7:short", "pkg/mod.py:34:value"]
    short, value = rows
    assert short["head"] == 'def short(path):\n    """The last part of a path."""\n'
    assert short["answer"] == "    return os.path.basename(path)\n"
    assert value["head"].startswith("    @property\n") and value["prompt"].endswith(value["head"])
    for r in rows:
        assert len(r["prompt"].encode()) <= 200 and len(r["prompt"]) - len(r["head"]) <= 40
        assert r["prompt"].endswith(r["head"]) and {"os", "LIMIT", "Counter"} <= set(r["names"].split())
        assert code_complete(r["prompt"], r["answer"], r) == 1.0
    assert function_rows("def broken(:\n", "x.py") == []
    # a form feed is no line end to Python (str.splitlines would shift every line number after it)
    fed = function_rows(MODULE.replace("LIMIT = 3\n", "LIMIT = 3\n\x0c\n"), "m.py", max_body_bytes=60)
    assert [(r["id"], r["head"]) for r in fed] == [("m.py:8:short", short["head"]), ("m.py:35:value", value["head"])]


def _tiny_corpus(root) -> str:
    """Twelve small modules, each with two qualifying functions."""
    for i in range(12):
        path = root / f"pkg{i % 3}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""Module {i}."""\nSCALE = {i}\n\n\ndef scaled_{i}(x):\n    """x times SCALE."""\n'
                        f'    return x * SCALE\n\n\ndef shifted_{i}(x, by=1):\n    """x moved by `by`."""\n'
                        '    y = x + by\n    return y\n')
    return str(root)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return _tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def code_data(tmp_path_factory, corpus) -> str:
    out = str(tmp_path_factory.mktemp("code"))
    make_code_dataset.main(["--out-dir", out, "--corpus", corpus, "--val-frac", "0.6", "--eval-frac", "0.4",
                            "--max-prompt-bytes", "160", "--context-bytes", "64"])
    return out


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_dataset_builder_takes_pretrainings_held_out_files_only(code_data, corpus, tmp_path):
    train, held = _read(os.path.join(code_data, "train.jsonl")), _read(os.path.join(code_data, "eval.jsonl"))
    assert train and held
    _, held_out = pretrain_moe.split_files(pretrain_moe.list_sources([corpus]), 0.6)
    held_out_rel = {os.path.relpath(p, corpus) for p in held_out}
    files = {"train": {r["id"].split(":")[0] for r in train}, "eval": {r["id"].split(":")[0] for r in held}}
    assert files["train"] | files["eval"] <= held_out_rel and not files["train"] & files["eval"]
    assert len(train) + len(held) == 2 * len(held_out_rel)
    for r in train + held:
        assert set(r) == {"prompt", "head", "answer", "names", "id"} and len(r["prompt"].encode()) <= 160
        assert code_complete(r["prompt"], r["answer"], r) == 1.0
    again = str(tmp_path / "again")  # deterministic: the same bytes
    make_code_dataset.main(["--out-dir", again, "--corpus", corpus, "--val-frac", "0.6", "--eval-frac", "0.4",
                            "--max-prompt-bytes", "160", "--context-bytes", "64"])
    for name in ("train.jsonl", "eval.jsonl"):
        with open(os.path.join(code_data, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read()


def test_dataset_builder_refuses_bad_input_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="1 .py file"):
        (tmp_path / "one").mkdir()
        (tmp_path / "one" / "a.py").write_text("x = 1\n")
        make_code_dataset.main(["--out-dir", str(tmp_path / "o"), "--corpus", str(tmp_path / "one")])
    with pytest.raises(SystemExit):
        make_code_dataset.main(["--out-dir", str(tmp_path / "o"), "--eval-frac", "1.5"])
    assert "--eval-frac must be in (0, 1), got 1.5" in capsys.readouterr().err


# --------------------------------------------------------------------------
# A short GRPO run on CPU
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_moe(tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE with pretrain_moe.py's byte tokenizer and vocabulary."""
    from torchtitan_grpo.models.demo_assets import TinyQwen3Moe, write_tiny_qwen3

    out = str(tmp_path_factory.mktemp("models") / "byte-moe")
    write_tiny_qwen3(out, TinyQwen3Moe(vocab_size=pretrain_moe.VOCAB, seed=5))
    pretrain_moe.write_byte_tokenizer(out)
    return out


def test_grpo_run_on_the_code_task_with_router_replay(tmp_path, byte_moe, code_data):
    """The config's run on CPU (fp32; server on CPU, pushed to over the
    config's "ipc", shared memory here), 3 steps with router replay: it
    finishes, and every step logs the figures the device run compares
    (reward, trainer-vs-rollout k3 and |dlogp|, IS weights, clip fraction,
    replayed positions); fp32 on both sides, sync pushes, so the trainer's
    log-probs are the server's. (A random model scores 0 here, so its weights
    do not move: tests/test_moe_e2e.py checks replay with moving weights.)"""
    dump = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", CONFIG, "--job.dump_folder", dump,
           "--model.hf_assets_path", byte_moe, "--rollout.dataset_path", os.path.join(code_data, "train.jsonl"),
           "--eval.dataset_path", os.path.join(code_data, "eval.jsonl"), "--eval.max_samples", "4",
           "--eval.interval", "0", "--training.steps", "3", "--training.seq_len", "192",
           "--training.mixed_precision_param", "float32", "--optimizer.implementation", "for-loop",
           "--grpo.prompts_per_step", "4", "--grpo.group_size", "4", "--grpo.micro_batch_size", "16",
           "--grpo.router_replay", "rollout", "--rollout.max_new_tokens", "24",
           "--inference.server_device", "cpu", "--inference.server_dtype", "float32",
           "--inference.max_model_len", "192", "--inference.max_batch_size", "16",
           "--weight_sync.dtype", "model",
           "--metrics.enable_tensorboard", "false"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(dump)
    steps = [m for m in rows if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        for key in ("reward/mean", "trainer_vs_rollout_k3", "trainer_vs_rollout_logprob_mean_abs_diff",
                    "offpolicy/is_weight_mean", "offpolicy/is_weight_max", "offpolicy/is_capped_frac",
                    "clip_fraction", "moe/replayed_tokens"):
            assert key in m, (key, sorted(m))
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["moe/replayed_tokens"] > 0
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
    assert [m["step"] for m in rows if "eval/pass@1" in m] == [0, 3]
    assert _servers_alive(byte_moe) == []
