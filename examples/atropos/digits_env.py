"""A two-turn digits task as an Atropos environment (atroposlib's ``BaseEnv``).

Turn 1: the model sees ``"3>"`` and answers. The environment replies with a
verdict and the question again (``"+3>"`` when the answer was right, ``"-3>"``
otherwise): environment tokens, never trained. Turn 2: the model answers
again and the trajectory is scored on that final answer with the built-in
digits reward (1 for the right digit then EOS, 0.5 for the right digit then
more). Both of the model's turns are trained; the prompt and the reply are
masked (``-100``), and every trained token carries the log-prob the server
sampled it with (``inference_logprobs``, 1.0 elsewhere) for the trainer's
off-policy correction.

Generation goes through atroposlib's ``SGLangServer`` handler (its token and
log-prob path, SGLang's ``/generate``), which the trainer's built-in server
speaks: turn 1 is one request for the group (``n`` = group size), turn 2 one
batched request holding every sequence's own context. Run it after the Atropos
API and the trainer, once the trainer has logged ``registered with Atropos``
(see README.md here)::

    OMP_NUM_THREADS=1 python examples/atropos/digits_env.py serve --env.tokenizer_name ./outputs/tiny-qwen3 \
        --env.replica_file ./outputs/atropos_demo/servers/replicas.txt

``--env.replica_file``: a file with one server URL per line (the trainer
writes the URLs of the servers it launches there once they are up, and
removes an earlier run's file when it starts); the environment samples from
those servers. Without it, ``--openai.base_url`` names the server as for any
Atropos environment.

Before anything else the environment checks that its tokenizer (a local
path) and its replica file exist: started before the trainer has written
them, it exits with one line saying so; so does it when the Atropos API
(``--env.rollout_server_url``) refuses connections as it registers. A listed URL that refuses
connections (a file left by an earlier run) is reported in one line, and the
environment waits until the file lists servers that answer. A group with a
non-finite score is dropped before it is posted: atroposlib's API cannot
encode one and would lose the whole batch it lands in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import sys
import time
from urllib.parse import urlsplit

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.server_handling.server_manager import ServerManager

from torchtitan_grpo.rollout.tasks import digits_answer, digits_reward

DEFAULT_MODEL = "./outputs/tiny-qwen3"
README = "examples/atropos/README.md"

logger = logging.getLogger("digits_env")


class DigitsEnvConfig(BaseEnvConfig):
    replica_file: str = ""
    """File with one inference server URL per line; empty: use the --openai servers."""
    max_answer_tokens: int = 2
    """Tokens per model turn (a digit and EOS)."""
    temperature: float = 1.0
    seed: int = 0


def preflight(tokenizer_name: str, replica_file: str) -> str | None:
    """What keeps the environment from starting, as one line (None: nothing).
    A tokenizer name that starts with ``.``, ``/`` or ``~`` is a local folder
    and must hold a tokenizer (anything else is a Hub id, left to transformers)."""
    if tokenizer_name.startswith((".", "/", "~")):
        folder = os.path.expanduser(tokenizer_name)
        if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return (f"digits_env: no tokenizer in {tokenizer_name} (--env.tokenizer_name): start the trainer first "
                    f"(it writes the demo model there), then this environment ({README})")
    if replica_file and not os.path.isfile(replica_file):
        return (f"digits_env: no server list at {replica_file} (--env.replica_file): start the trainer first and "
                f"this environment once it has logged 'registered with Atropos' ({README})")
    return None


def read_urls(path: str) -> list[str]:
    """The server URLs a replica file lists (none if it is missing)."""
    try:
        with open(path) as f:
            return [u.strip() for u in f if u.strip() and not u.startswith("#")]
    except FileNotFoundError:
        return []


async def accepts_connections(url: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at ``url``'s host and port."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def finite_scores(group: dict) -> bool:
    """A group atroposlib's API can hand out: every score a finite number
    (a NaN or inf one makes its ``/batch`` answer 500 and lose the batch)."""
    return all(isinstance(s, (int, float)) and math.isfinite(s) for s in group["scores"])


def two_turn_sequence(prompt_ids: list[int], turn1: tuple[list[int], list[float]], reply_ids: list[int],
                      turn2: tuple[list[int], list[float]]) -> dict:
    """tokens / masks / inference_logprobs of one trajectory, in Atropos's
    convention: ``-100`` and 1.0 on what the model did not generate."""
    (out1, lp1), (out2, lp2) = turn1, turn2
    return {
        "tokens": prompt_ids + out1 + reply_ids + out2,
        "masks": [-100] * len(prompt_ids) + out1 + [-100] * len(reply_ids) + out2,
        "inference_logprobs": [1.0] * len(prompt_ids) + lp1 + [1.0] * len(reply_ids) + lp2,
    }


class DigitsTwoTurnEnv(BaseEnv):
    name = "digits_two_turn"
    env_config_cls = DigitsEnvConfig

    def __init__(self, config: DigitsEnvConfig, server_configs, slurm: bool = False, testing: bool = False):
        problem = preflight(config.tokenizer_name, config.replica_file)
        if problem is not None:  # before atroposlib loads the tokenizer (a long traceback when it is missing)
            print(problem, file=sys.stderr)
            raise SystemExit(2)
        super().__init__(config, server_configs, slurm=slurm, testing=testing)

    @classmethod
    def config_init(cls) -> tuple[DigitsEnvConfig, list[APIServerConfig]]:
        model = os.environ.get("DIGITS_MODEL", DEFAULT_MODEL)
        env = DigitsEnvConfig(
            tokenizer_name=model, group_size=16, use_wandb=False, wandb_name="digits_two_turn",
            max_token_length=64, max_batches_offpolicy=2, total_steps=-1, batch_size=-1,
            ensure_scores_are_not_same=False,  # the trainer counts constant groups itself
            steps_per_eval=0, max_num_workers_per_node=4,
        )
        server = APIServerConfig(model_name=model, base_url="http://127.0.0.1:30000/v1", api_key="x",
                                 server_type="sglang", health_check=False, num_max_requests_at_once=64, timeout=120)
        return env, [server]

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.eos = self.tokenizer.eos_token_id
        if self.config.replica_file:
            urls = await self._wait_for_replicas(self.config.replica_file)
            template = self.server.servers[0].config
            configs = [template.model_copy(update={"base_url": u.rstrip("/") + "/v1"}) for u in urls]
            self.server = ServerManager(configs, server_class=self.server_cls)

    async def register_env(self) -> None:
        """atroposlib's registration, once the Atropos API accepts connections:
        down, its three retries would each log an error and end in four chained
        tracebacks; here it is one line and exit 2."""
        url = self.config.rollout_server_url
        if not await accepts_connections(url):
            print(f"digits_env: the Atropos API at {url} (--env.rollout_server_url) refuses connections: start it "
                  f"first (run-api --port 8000), then the trainer, then this environment ({README})", file=sys.stderr)
            raise SystemExit(2)
        await super().register_env()

    @staticmethod
    async def _wait_for_replicas(path: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> list[str]:
        """The URLs ``path`` lists once every one of them accepts connections;
        each that refuses is reported once (the trainer rewrites the file when
        its servers are up)."""
        deadline = time.monotonic() + timeout_s
        reported: set[str] = set()
        while time.monotonic() < deadline:
            urls = read_urls(path)
            refused = [u for u in urls if not await accepts_connections(u)]
            if urls and not refused:
                return urls
            for u in refused:
                if u not in reported:
                    reported.add(u)
                    logger.warning("digits_env: %s lists %s, which refuses connections (left by an earlier run? "
                                   "the trainer rewrites it once its servers are up); waiting", path, u)
            await asyncio.sleep(poll_s)
        print(f"digits_env: no server in {path} accepted connections for {timeout_s:.0f}s: is the trainer running? "
              f"({README})", file=sys.stderr)
        raise SystemExit(2)

    async def get_next_item(self) -> dict:
        d = self.rng.randrange(10)
        prompt = f"{d}>"
        return {"prompt": prompt, "answer": digits_answer(prompt)}

    async def _generate(self, input_ids: list[int] | list[list[int]], n: int
                        ) -> list[tuple[list[int], list[float], str]]:
        """``n`` samples of one prompt, or one sample of each prompt of a batch
        (a list of token-id lists: SGLang's batched ``/generate``, answered in
        prompt order, one request for the whole batch)."""
        _, outs, lps, finishes = await self.server.tokens_and_logprobs_completion(
            input_ids=list(input_ids), n=n, max_tokens=self.config.max_answer_tokens,
            temperature=self.config.temperature, stop_token_ids=[self.eos])
        reasons = [f.get("type", "stop") if isinstance(f, dict) else (f or "stop") for f in finishes]
        return list(zip(outs, lps, reasons))

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def collect_trajectories(self, item: dict) -> tuple[ScoredDataGroup | None, list]:
        prompt_ids = self.tokenizer.encode(item["prompt"], add_special_tokens=False)
        first = await self._generate(prompt_ids, self.config.group_size)  # turn 1: the whole group at once
        # The environment's reply depends on each sequence's first answer; turn 2
        # continues every sequence from its own context, all in one batched request.
        replies = []
        for out1, _, _ in first:
            verdict = "+" if self._text(out1).strip() == item["answer"] else "-"
            replies.append(self.tokenizer.encode(verdict + item["prompt"], add_special_tokens=False))
        second = await self._generate([prompt_ids + out1 + reply for (out1, _, _), reply in zip(first, replies)], 1)
        if len(second) != len(first):
            raise RuntimeError(f"the server answered {len(second)} of {len(first)} second-turn prompts")
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=[])
        for (out1, lp1, _), reply, (out2, lp2, finish) in zip(first, replies, second):
            seq = two_turn_sequence(prompt_ids, (out1, lp1), reply, (out2, lp2))
            for key in ("tokens", "masks", "inference_logprobs"):
                group[key].append(seq[key])
            group["scores"].append(digits_reward(item["prompt"], self._text(out2), item))
            group["overrides"].append({"finish_reason": finish})
        if not finite_scores(group):
            logger.warning("digits_env: dropped a group of prompt %r with a non-finite score %s", item["prompt"],
                           group["scores"])
            return None, []
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        return None


if __name__ == "__main__":
    DigitsTwoTurnEnv.cli()
