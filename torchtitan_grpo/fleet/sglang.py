"""SGLang 0.5.x HTTP protocol (see PROTOCOLS.md): request bodies and strict
parsing of responses. The built-in server speaks the same protocol."""

from __future__ import annotations

from typing import Any

from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.fleet.types import Completion, SamplingParams, is_logprob, need, parse_spans
# The weight-update bodies are shared with the weight push: protocol.sglang; re-exported here.
from torchtitan_grpo.protocol.sglang import init_group_request, update_request  # noqa: F401


def generate_request(prompt_ids: list[int], n: int, p: SamplingParams, routes: bool = False) -> dict[str, Any]:
    """Body of POST /generate for one prompt and n samples with token logprobs
    (and each sample's routed experts with ``routes``)."""
    sp: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "n": n,
    }
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if routes:
        body[route_codec.REQUEST_FIELD] = True
    return body


def parse_generate(body: Any, n: int, replica: str, route_shape: tuple[int, int] | None = None) -> list[Completion]:
    """Validate and convert a /generate reply for one prompt with n samples;
    ``route_shape`` (moe layers, top_k): decode each sample's routed experts."""
    items = body if isinstance(body, list) else [body]
    need(len(items) == n, replica, "(top level)", f"expected {n} results, got {len(items)}")
    out = []
    for k, it in enumerate(items):
        where = f"[{k}]" if isinstance(body, list) else ""
        need(isinstance(it, dict), replica, f"{where}", "not an object")
        ids = it.get("output_ids")
        need(isinstance(ids, list) and all(isinstance(t, int) for t in ids), replica, f"{where}output_ids", "not a list of ints")
        meta = it.get("meta_info")
        need(isinstance(meta, dict), replica, f"{where}meta_info", "missing or not an object")
        lps = meta.get("output_token_logprobs")
        need(isinstance(lps, list), replica, f"{where}meta_info.output_token_logprobs", "missing (was return_logprob sent?)")
        need(len(lps) == len(ids), replica, f"{where}meta_info.output_token_logprobs",
              f"{len(lps)} entries for {len(ids)} output_ids")
        logprobs = []
        for j, e in enumerate(lps):
            need(isinstance(e, (list, tuple)) and len(e) >= 2, replica,
                  f"{where}meta_info.output_token_logprobs[{j}]", "not [logprob, token_id, text]")
            lp, tid = e[0], e[1]
            need(is_logprob(lp), replica, f"{where}meta_info.output_token_logprobs[{j}][0]",
                 f"not a finite logprob: {lp!r}")
            need(tid == ids[j], replica, f"{where}meta_info.output_token_logprobs[{j}][1]",
                  f"token id {tid!r} != output_ids[{j}] {ids[j]!r}")
            logprobs.append(float(lp))
        fr = meta.get("finish_reason")
        need(isinstance(fr, dict) and fr.get("type") in ("stop", "length", "abort"), replica,
              f"{where}meta_info.finish_reason", f"unexpected value {fr!r}")
        version = meta.get("weight_version", "default")
        need(isinstance(version, str), replica, f"{where}meta_info.weight_version", f"not a string: {version!r}")
        spans = [(version, 0, len(ids))] if ids else []
        wvs = meta.get("weight_versions")  # the built-in server's per-token spans (when the version changed)
        if wvs:
            spans = parse_spans(wvs, len(ids), replica, f"{where}meta_info.weight_versions")
        versions = [v for v, _, _ in spans] or [version]
        routes = None
        if route_shape is not None:
            at = f"{where}meta_info.{route_codec.SGLANG_FIELD}"
            routes = route_codec.decode_sglang(meta.get(route_codec.SGLANG_FIELD), *route_shape, replica, at)
            prompt_len = meta.get("prompt_tokens")
            if isinstance(prompt_len, int):
                route_codec.for_sample(routes, prompt_len, len(ids), replica, at)
        out.append(Completion(ids, logprobs, fr["type"], version, versions, replica, spans, routes))
    return out
