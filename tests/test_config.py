"""Start-up checks: every bad input fails with a message naming the key or file."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from torchtitan_grpo.config.checks import ConfigError
from torchtitan_grpo.config.parse import parse_config

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_demo_config_parses_with_cli_override():
    cfg = parse_config(["--job.config_file", DEMO, "--grpo.group_size", "4"])
    assert cfg.grpo.group_size == 4
    assert cfg.grpo.prompts_per_step == 16  # from the TOML
    assert cfg.inference.backend == "builtin"


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "train_configs"))))
def test_every_shipped_config_parses_and_validates(name, tiny_model_dir, tmp_path):
    """Each TOML under train_configs/ has only known keys and valid values
    (a renamed key would otherwise surface first on a user's GPUs). Paths to
    the user's model and data point at stand-ins, and GPU placements at the
    CPU (nccl's GPU check needs GPUs); every other key is the file's own."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = os.path.join(ROOT, "train_configs", name)
    cfg = parse_config(["--job.config_file", path, "--model.hf_assets_path", tiny_model_dir,
                        "--rollout.dataset_path", str(data), "--eval.dataset_path", str(data),
                        "--weight_sync.transport", "gloo", "--inference.server_devices", "cpu"])
    assert cfg.job.description  # each says what it is for
    if name == "qwen3_4b_long.toml":  # the long-rollout recipe keeps what docs/LONG_ROLLOUTS.md says
        assert cfg.activation_checkpoint.selective_ac_option == "op" and cfg.grpo.logprob_chunk_tokens > 0
        assert cfg.grpo.micro_batch_tokens >= cfg.training.seq_len >= cfg.rollout.max_new_tokens + 256
        assert cfg.inference.kv_cache == "auto" and cfg.weight_sync.fanout == "broadcast"


def test_a_model_path_to_be_written_is_not_warned_about(tmp_path, monkeypatch, caplog):
    # The demo writes its tiny model on the first run; TorchTitan's parser
    # would open that run with "HF assets path ... does not exist!".
    monkeypatch.chdir(tmp_path)  # no ./outputs/tiny-qwen3 here yet
    with caplog.at_level("WARNING"):
        cfg = parse_config(["--job.config_file", DEMO])
    assert cfg.grpo.tiny_model_if_missing and not os.path.exists(cfg.model.hf_assets_path)
    assert not [r for r in caplog.records if "does not exist" in r.getMessage()]


def test_unknown_toml_key_is_named(tmp_path):
    path = _write(tmp_path, "[grpo]\ngroup_sise = 4\n")
    with pytest.raises(ConfigError, match=r"grpo\.group_sise"):
        parse_config(["--job.config_file", path])


def test_unknown_toml_section_is_named(tmp_path):
    path = _write(tmp_path, "[grop]\ngroup_size = 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key grop"):
        parse_config(["--job.config_file", path])


@pytest.mark.parametrize("arg,value,key", [
    ("--grpo.group_size", "1", "grpo.group_size"),
    ("--rollout.temperature", "0", "rollout.temperature"),
    ("--rollout.top_p", "1.5", "rollout.top_p"),
    ("--rollout.task", "nope", "rollout.task"),
    ("--weight_sync.bucket_size_mb", "0", "weight_sync.bucket_size_mb"),
    ("--inference.num_servers", "0", "inference.num_servers"),
])
def test_bad_values_name_the_key(arg, value, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(["--job.config_file", DEMO, arg, value])


def test_external_backend_needs_urls():
    with pytest.raises(ConfigError, match=r"inference\.urls"):
        parse_config(["--job.config_file", DEMO, "--inference.backend", "sglang"])


def test_missing_model_dir_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    path = _write(tmp_path, f'[model]\nname = "qwen3"\nhf_assets_path = "{missing}"\n')
    with pytest.raises(ConfigError, match=r"model\.hf_assets_path.*no-such-model"):
        parse_config(["--job.config_file", path])


def test_a_missing_model_path_given_by_the_user_is_an_error_not_a_new_model(tmp_path):
    """grpo.tiny_model_if_missing (on in the demo config) writes the tiny model
    only at the demo's own default path; any other path that holds no model
    is a config error naming the key, and nothing is written there."""
    missing = tmp_path / "nonexistent" / "model"
    with pytest.raises(ConfigError, match=r"^config key model\.hf_assets_path = '.*nonexistent/model': does not exist; "
                                          r"grpo\.tiny_model_if_missing writes the tiny demo models only at the "
                                          r"demos' own \./outputs/tiny-qwen3 and \./outputs/tiny-qwen3-moe"):
        parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", str(missing)])
    assert not missing.exists() and not missing.parent.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"model\.hf_assets_path = '.*empty': has no config\.json"):
        parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", str(empty)])
    # Written first (the demo_assets CLI), the same path is a model like any other.
    from torchtitan_grpo.models.demo_assets import main as write_demo_model

    assert write_demo_model([str(missing)]) == str(missing)
    assert parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", str(missing)]).model.hf_assets_path \
        == str(missing)


def test_the_demo_default_model_path_may_be_missing(tmp_path, monkeypatch):
    """The demo's own ./outputs/tiny-qwen3 (relative to the working directory),
    however it is spelled, is accepted while missing: the trainer writes it."""
    monkeypatch.chdir(tmp_path)
    assert parse_config(["--job.config_file", DEMO]).model.hf_assets_path == "./outputs/tiny-qwen3"
    for spelling in ("outputs/tiny-qwen3", str(tmp_path / "outputs" / "tiny-qwen3")):
        assert parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", spelling])
    assert not (tmp_path / "outputs").exists()  # validation writes nothing
    # Without grpo.tiny_model_if_missing even the demo path must hold a model.
    with pytest.raises(ConfigError, match=r"model\.hf_assets_path = '\./outputs/tiny-qwen3': does not exist: it must "
                                          r"be an HF checkpoint directory"):
        parse_config(["--job.config_file", DEMO, "--grpo.no-tiny_model_if_missing"])


def test_jsonl_task_needs_existing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.dataset_path"):
        parse_config(["--job.config_file", DEMO, "--rollout.task", "jsonl",
                      "--rollout.dataset_path", str(tmp_path / "x.jsonl"), "--rollout.reward_fn", "m:f"])


def test_disk_transport_needs_sglang_protocol():
    with pytest.raises(ConfigError, match=r"weight_sync\.transport.*vLLM"):
        parse_config(["--job.config_file", DEMO, "--weight_sync.transport", "disk", "--inference.backend", "vllm",
                      "--inference.urls", "http://127.0.0.1:1"])


@pytest.mark.parametrize("args,line", [
    (["--grpo.gruop_size", "4"], "unknown config key --grpo.gruop_size; did you mean --grpo.group_size?"),
    (["--grpo.temperature=0.7"], "unknown config key --grpo.temperature; did you mean --rollout.temperature?"),
    (["--grpo.group_size", "abc"], "config key grpo.group_size = 'abc': must be an integer (default 8)"),
    (["--rollout.top_p", "high"], "config key rollout.top_p = 'high': must be a number (default 1.0)"),
    (["--weight-sync.mode", "asyn"], "config key weight_sync.mode = 'asyn': must be one of 'async', 'sync', 'off'"),
    (["--grpo.group_size"], "config key grpo.group_size: --grpo.group_size needs a value"),
    (["--grpo.group_size", "4", "5"], "command line: Unrecognized options: 5"),  # tyro's own finding, one line
])
def test_a_misspelled_or_wrong_typed_key_on_the_command_line_is_one_line(args, line, capsys):
    """Not tyro's 10-line box: one line naming the key and the nearest valid
    one (or what the value must be); grpo_train.py prints it and exits 2."""
    with pytest.raises(ConfigError) as e:
        parse_config(["--job.config_file", DEMO, *args])
    assert str(e.value) == line
    assert capsys.readouterr().err == ""  # no box printed beside it


def test_a_value_may_start_with_dashes_where_no_key_is_named():
    """inference.engine_args passes engine flags on (``--enforce-eager,...``):
    such a value is not mistaken for a missing one; a key after a key is."""
    from torchtitan_grpo.config.keys import check_cli_args

    keys = {"inference.engine_args": (list[str], []), "grpo.group_size": (int, 8)}
    check_cli_args(["--inference.engine_args", "--enforce-eager,--max-num-seqs,256"], keys, ConfigError)
    with pytest.raises(ConfigError, match=r"^config key grpo\.group_size: --grpo\.group_size needs a value$"):
        check_cli_args(["--grpo.group_size", "--inference.engine_args", "--x"], keys, ConfigError)


@pytest.mark.parametrize("text,line", [
    ("[grpo]\ngruop_size = 4\n", "unknown config key grpo.gruop_size in '{path}' ([grpo]); did you mean grpo.group_size?"),
    ("[grop]\ngroup_size = 4\n", "unknown config key grop.group_size in '{path}' ([grop]); did you mean grpo.group_size?"),
    ('[grpo]\ngroup_size = "abc"\n', "config key grpo.group_size = 'abc' in '{path}': must be an integer (default 8)"),
    ("[grpo]\ngroup_size = 4.5\n", "config key grpo.group_size = 4.5 in '{path}': must be an integer (default 8)"),
    ('[checkpoint]\nenable = "yes"\n', "config key checkpoint.enable = 'yes' in '{path}': must be true or false "
                                       "(default False)"),
])
def test_a_misspelled_or_wrong_typed_key_in_the_toml_is_one_line(tmp_path, text, line):
    """The file's keys too: a wrong type would otherwise pass the parser and
    fail later as a TypeError deep in the checks."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        parse_config(["--job.config_file", path])
    assert str(e.value) == line.format(path=path)


def test_bad_choice_in_the_toml_names_the_key(tmp_path):
    """A Literal key set in the file (the command line's choices are tyro's to check)."""
    text = open(DEMO).read().replace("[weight_sync]\n", '[weight_sync]\nstaging = "gpu"\n')
    assert 'staging = "gpu"' in text
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"weight_sync\.staging = 'gpu' in '.*bad\.toml': must be one of 'device', 'host'"):
        parse_config(["--job.config_file", str(path)])


@pytest.mark.parametrize("server_device,local_ranks,ok", [
    ("cuda", "1", False), ("cuda:0", "1", False), ("cuda:1", "2", False),
    ("cuda:1", "1", True), ("cuda:2", "2", True),
])
def test_nccl_push_to_a_builtin_server_on_a_trainer_gpu_is_refused_at_start(monkeypatch, server_device,
                                                                             local_ranks, ok):
    """NCCL cannot join two processes on one GPU, and would only say so at the first push."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    argv = ["--job.config_file", DEMO, "--weight_sync.transport", "nccl", "--inference.server_device", server_device]
    if ok:
        assert parse_config(argv).inference.server_device == server_device
        return
    with pytest.raises(ConfigError, match=r"inference\.server_device.*would share cuda:\d with a trainer rank"
                                          r".*weight_sync\.transport = \"ipc\""):
        parse_config(argv)
    # The same GPU is fine when the weights do not go over NCCL.
    assert parse_config(argv[:3] + ["gloo"] + argv[4:]).weight_sync.transport == "gloo"


def test_server_device_must_name_a_device():
    with pytest.raises(ConfigError, match=r"inference\.server_device = 'cuda1'"):
        parse_config(["--job.config_file", DEMO, "--inference.server_device", "cuda1"])


def test_ipc_transport_needs_device_staging_and_takes_either_protocol():
    vllm_ipc = parse_config(["--job.config_file", DEMO, "--weight_sync.transport", "ipc", "--inference.backend",
                             "vllm", "--inference.urls", "http://127.0.0.1:1"])  # vLLM's IPC engine
    assert vllm_ipc.weight_sync.transport == "ipc" and vllm_ipc.inference.backend == "vllm"
    with pytest.raises(ConfigError, match=r"weight_sync\.staging = 'host': must be \"device\""):
        parse_config(["--job.config_file", DEMO, "--weight_sync.transport", "ipc", "--weight_sync.staging", "host"])
    assert parse_config(["--job.config_file", DEMO, "--weight_sync.transport", "ipc"]).weight_sync.transport == "ipc"


def test_reward_fn_that_cannot_be_loaded_is_named_before_anything_starts():
    with pytest.raises(ConfigError, match=r"rollout\.reward_fn = 'tests\.reward_fixtures:nope': cannot be loaded"
                                          r".*has no attribute 'nope'"):
        parse_config(["--job.config_file", DEMO, "--rollout.reward_fn", "tests.reward_fixtures:nope"])
    with pytest.raises(ConfigError, match=r"rollout\.reward_fn.*module 'no_such_pkg\.rewards' not found"):
        parse_config(["--job.config_file", DEMO, "--rollout.reward_fn", "no_such_pkg.rewards:score"])
    with pytest.raises(ConfigError, match=r"rollout\.reward_fn = 'maths': must look like .* built-in name"):
        parse_config(["--job.config_file", DEMO, "--rollout.reward_fn", "maths"])
    # a built-in name needs no module path
    assert parse_config(["--job.config_file", DEMO, "--rollout.reward_fn", "math"]).rollout.reward_fn == "math"


def test_pipeline_depth():
    from torchtitan_grpo.config.job_config import pipeline_depth

    cfg = lambda *a: parse_config(["--job.config_file", DEMO, *a])  # noqa: E731
    assert pipeline_depth(cfg()) == 0  # the demo pushes in sync mode: serial, exactly on-policy
    assert pipeline_depth(cfg("--weight_sync.mode", "async")) == 1
    assert pipeline_depth(cfg("--weight_sync.mode", "off")) == 1
    assert pipeline_depth(cfg("--weight_sync.mode", "async", "--rollout.pipeline_depth", "3")) == 3
    assert pipeline_depth(cfg("--weight_sync.mode", "async", "--rollout.pipeline_depth", "3",
                              "--grpo.max_staleness", "2")) == 2  # never deeper than the staleness bound
    assert pipeline_depth(cfg("--weight_sync.mode", "async", "--rollout.pipeline_depth", "0")) == 0
    with pytest.raises(ConfigError, match=r"rollout\.pipeline_depth = 1: must be 0 or -1 with weight_sync\.mode"):
        cfg("--rollout.pipeline_depth", "1")
    with pytest.raises(ConfigError, match=r"rollout\.pipeline_depth = -2"):
        cfg("--weight_sync.mode", "async", "--rollout.pipeline_depth", "-2")


def test_client_process():
    """auto: the rollout client in a process of its own exactly when pipelined."""
    from torchtitan_grpo.config.job_config import client_process

    cfg = lambda *a: parse_config(["--job.config_file", DEMO, *a])  # noqa: E731
    assert not client_process(cfg())  # serial (sync push): nothing runs beside the client
    assert client_process(cfg("--weight_sync.mode", "async"))
    assert not client_process(cfg("--weight_sync.mode", "async", "--rollout.pipeline_depth", "0"))
    assert not client_process(cfg("--weight_sync.mode", "async", "--rollout.client_process", "off"))
    assert client_process(cfg("--rollout.client_process", "on"))
    with pytest.raises(ConfigError, match=r"rollout\.client_process = 'on': can be \"on\" only with rollout\.source"):
        cfg("--rollout.client_process", "on", "--rollout.source", "atropos")
    assert cfg().rollout.client_max_restarts == 2
    with pytest.raises(ConfigError, match=r"rollout\.client_max_restarts = -1: must be >= 0"):
        cfg("--rollout.client_max_restarts", "-1")


def test_api_key_from_the_environment(monkeypatch):
    from torchtitan_grpo.config.job_config import api_key

    monkeypatch.delenv("GRPO_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"inference\.api_key = 'env:GRPO_TEST_KEY': environment variable"):
        parse_config(["--job.config_file", DEMO, "--inference.api_key", "env:GRPO_TEST_KEY"])
    monkeypatch.setenv("GRPO_TEST_KEY", "s3cret")
    assert api_key(parse_config(["--job.config_file", DEMO, "--inference.api_key", "env:GRPO_TEST_KEY"])) == "s3cret"


BAD_CONFIGS = [  # (arguments, what the one error line must say)
    (["--grpo.group_size", "0"], "config key grpo.group_size = 0: must be >= 2"),
    (["--inference.urls", "http://127.0.0.1:1", "--inference.backend", "sglang"],
     "config key inference.urls: http://127.0.0.1:1 is not reachable"),
    (["--rollout.reward_fn", "no_such_pkg.rewards:score"], "config key rollout.reward_fn"),
    (["--model.hf_assets_path", "/nonexistent/model"],
     "config key model.hf_assets_path = '/nonexistent/model': does not exist; grpo.tiny_model_if_missing"),
]


# A process that imports grpo_train.py's modules once (torch, TorchTitan:
# ~6 CPU-s a process, all of this test's cost), then forks one child per bad
# config; each child runs the script as ``__main__`` with that config's
# arguments, its stdout and stderr to files, and exits as the script does.
_FORK_EACH = r"""
import json, os, runpy, sys, traceback
script, jobs = sys.argv[1], json.loads(sys.argv[2])
runpy.run_path(script, run_name="grpo_train_imports")  # the imports only: its __main__ block is not run
pids = []
for args, out, err in jobs:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = [script, *args]
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:  # as the interpreter exits on it
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]), flush=True)
"""


def test_a_bad_config_is_one_naming_line_and_starts_nothing(tmp_path):
    """Each bad config (grpo_train.py run as ``__main__``, one forked process
    each from one that imported its modules once: each would spend its time
    importing, not failing) exits 2 with one naming line, no traceback, no
    server started and no model written; a misspelled key too (a process of
    its own, from the command line), with the nearest valid key, and the same
    line in torchrun's error file."""
    jobs, dumps = [], []
    for k, (args, naming) in enumerate(BAD_CONFIGS):
        dump = tmp_path / f"run{k}"
        dumps.append(dump)
        jobs.append((["--job.config_file", DEMO, "--job.dump_folder", str(dump), *args],
                     str(tmp_path / f"run{k}.out"), str(tmp_path / f"run{k}.err")))
    forked = subprocess.Popen([sys.executable, "-c", _FORK_EACH, os.path.join(ROOT, "grpo_train.py"), json.dumps(jobs)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    error_file = tmp_path / "error.json"  # where torchrun reads a failed worker's message ("Root Cause")
    unknown = subprocess.Popen([sys.executable, os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO,
                                "--grpo.gruop_size", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=ROOT, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file)))
    try:
        codes, forked_err = forked.communicate(timeout=300)  # a hang guard (2 imports of torch at once on 2 cores)
        assert forked.returncode == 0, forked_err
        codes = json.loads(codes)
        for (args, naming), dump, (_, out, err), code in zip(BAD_CONFIGS, dumps, jobs, codes, strict=True):
            stdout, stderr = open(out).read(), open(err).read()
            assert code == 2, (args, stdout + stderr)
            errors = [line for line in stderr.splitlines() if line.startswith("grpo_train.py: error: ")]
            assert len(errors) == 1 and naming in errors[0], (args, stderr)
            assert "Traceback" not in stdout + stderr, args
            assert not (dump / "servers").exists(), args  # no server was started
        assert not os.path.exists("/nonexistent/model")  # and no model was written
        out = unknown.communicate(timeout=300)[0]
        line = "unknown config key --grpo.gruop_size; did you mean --grpo.group_size?"
        assert unknown.returncode == 2 and out == f"grpo_train.py: error: {line}\n", out
        assert json.loads(error_file.read_text())["message"]["message"] == line
    finally:
        for p in (forked, unknown):
            if p.poll() is None:
                p.kill()


def test_missing_and_invalid_config_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' \(--job\.config_file\) does not exist"):
        parse_config(["--job.config_file", str(tmp_path / "nope.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpo\ngroup_size = 4\n")
    with pytest.raises(ConfigError, match=r"config file '.*bad\.toml' is not valid TOML"):
        parse_config(["--job.config_file", str(bad)])


@pytest.mark.parametrize("key,value,message", [
    ("inference.request_timeout_s", "0", "must be > 0"),
    ("inference.startup_timeout_s", "-1", "must be > 0"),
    ("inference.server_max_restarts", "-1", "must be >= 0"),
    ("rollout.reward_timeout_s", "0", "must be > 0"),
    ("weight_sync.replica_deadline_s", "0", "must be > 0"),
    ("weight_sync.init_timeout_s", "0", "must be > 0"),
    ("grpo.clip_low", "1.0", r"must be in \[0, 1\)"),
    ("grpo.clip_low", "-0.1", r"must be in \[0, 1\)"),
    ("grpo.clip_high", "-0.1", "must be >= 0"),
])
def test_bounds_of_timeout_and_clip_keys(key, value, message):
    with pytest.raises(ConfigError, match=rf"config key {re.escape(key)} = .*: {message}"):
        parse_config(["--job.config_file", DEMO, f"--{key}", value])


def test_inference_keys_become_flags_the_started_servers_parse(tmp_path, monkeypatch):
    """What the trainer passes its built-in servers ([inference] kv_cache,
    max_model_len, chat_template) parses as the server's own flags; a chat
    template that is neither a file nor a template is a config error naming
    the key."""
    import os

    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.server.app import parse_args
    from torchtitan_grpo.session import server_engine_args

    demo = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train_configs", "demo_cpu.toml")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.chdir(tmp_path)  # a relative path: the servers get it made absolute
    cfg = parse_config(["--job.config_file", demo, "--inference.kv_cache", "dynamic", "--inference.max_model_len",
                        "64", "--inference.chat_template", "chat.jinja", "--inference.max_batch_size", "96"])
    args = server_engine_args(cfg.inference)
    monkeypatch.chdir("/")
    srv = parse_args(["--model", "m", "--port", "0", *args])
    assert (srv.kv_cache, srv.max_model_len, srv.chat_template) == ("dynamic", 64, template.read_text())
    assert srv.max_batch_size == 96
    with pytest.raises(ConfigError, match=r"inference\.chat_template"):
        parse_config(["--job.config_file", demo, "--inference.chat_template", "no-such-file.jinja"])



def test_server_devices_spread_the_started_servers_and_auto_takes_the_gpus_no_trainer_rank_uses(monkeypatch):
    """inference.server_devices: server k on entry k mod the list; ["auto"]:
    this node's GPUs from cuda:LOCAL_WORLD_SIZE on; none left is an error
    naming the key; NCCL onto a trainer's GPU is refused for any entry."""
    import torchtitan_grpo.config.job_config as config

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = parse_config(["--job.config_file", DEMO, "--inference.num_servers", "3",
                        "--inference.server_devices", "cuda:2,cuda:3"])
    assert config.server_devices(cfg) == ("inference.server_devices", ["cuda:2", "cuda:3", "cuda:2"])
    assert not config.servers_share_trainer_gpu(cfg)
    assert config.server_devices(parse_config(["--job.config_file", DEMO]))[1] == ["cpu"]
    monkeypatch.setattr(config, "_gpu_count", lambda: 4)
    auto = parse_config(["--job.config_file", DEMO, "--inference.num_servers", "2", "--inference.server_devices", "auto"])
    assert config.server_devices(auto)[1] == ["cuda:2", "cuda:3"]
    monkeypatch.setattr(config, "_gpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"inference\.server_devices.*none is left for the servers"):
        parse_config(["--job.config_file", DEMO, "--inference.server_devices", "auto"])
    with pytest.raises(ConfigError, match=r"inference\.server_devices.*would share cuda:1 with a trainer rank"):
        parse_config(["--job.config_file", DEMO, "--weight_sync.transport", "nccl", "--inference.num_servers", "2",
                      "--inference.server_devices", "cuda:2,cuda:1"])
    with pytest.raises(ConfigError, match=r"inference\.server_devices.*'gpu2'"):
        parse_config(["--job.config_file", DEMO, "--inference.server_devices", "gpu2"])
