"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` on CPU
(tests/test_engine_launch.py): it takes exactly the flags the trainer's
launcher passes a vLLM (an unknown one fails, as vLLM's parser does),
refuses to start without the dev mode the RL routes need, and serves through
the built-in server, run as a child process the way vLLM runs its engine
core, so a kill -9 of this process leaves that child behind holding the port
unless the launcher sweeps the process group."""

import argparse
import json
import os
import subprocess
import sys

p = argparse.ArgumentParser(prog="fake-vllm")
for flag in ("--model", "--host", "--port", "--dtype", "--seed", "--served-model-name",
             "--gpu-memory-utilization", "--max-model-len", "--weight-transfer-config", "--logprobs-mode"):
    p.add_argument(flag)
p.add_argument("--enforce-eager", action="store_true")
p.add_argument("--use-fp64-gumbel", action="store_true")
a = p.parse_args()
if os.environ.get("FAKE_VLLM_FAIL"):  # a start that fails as 0.26's did without ray: the cause, then the wrapper
    print("(EngineCore pid=1) ERROR Traceback (most recent call last):", flush=True)
    print(f"(EngineCore pid=1) ERROR ModuleNotFoundError: No module named '{os.environ['FAKE_VLLM_FAIL']}'", flush=True)
    print("(APIServer pid=0) RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
    sys.exit(1)
if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
    sys.exit("fake vLLM: VLLM_SERVER_DEV_MODE=1 is needed for the RL routes")
transfer = json.loads(a.weight_transfer_config)["backend"] if a.weight_transfer_config else ""
if transfer == "ipc" and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
    sys.exit("fake vLLM: the IPC engine refuses handles without VLLM_ALLOW_INSECURE_SERIALIZATION=1")
with open(os.path.join(os.environ["FAKE_VLLM_RECORD"], f"argv.{os.getpid()}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "child": None}, f)
child = subprocess.Popen([sys.executable, "-m", "torchtitan_grpo.server", "--model", a.model,
                          "--port", a.port, "--host", a.host, "--device", "cpu", "--dtype", "float32",
                          "--seed", a.seed])
with open(os.path.join(os.environ["FAKE_VLLM_RECORD"], f"argv.{os.getpid()}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "child": child.pid,
               "torchrun_env": sorted(k for k in os.environ if k.startswith("TORCHELASTIC_") or k in ("RANK", "MASTER_PORT"))}, f)
sys.exit(child.wait())
