"""The first GPU run of the host tier: does P pull a turn D no longer holds in HBM from D's host tier?

Run it against a deployment started from a deploy.toml with a ``[host_tier]`` table (the start scripts
render the two-tier ``--kv-transfer-config`` and the router's ``--host-tier-*`` flags), with a short D TTL
so that the check does not wait long, e.g. ``decoder_kv_blocks_ttl = 20`` in ``[connector]``::

    bash impl/deploy/check_host_tier.sh --config my.toml --gap 30

It sends a two-turn conversation through the router, waits ``--gap`` seconds (longer than D's TTL: the
HBM copy is freed, the host tier's stays), sends the second turn and reads:

* the router's answer headers: ``X-Bidikv-Reuse-Tier`` (``host``: P reported more cached tokens than its
  own cache held) and ``X-Bidikv-Prefill-Cached-Tokens``;
* P's ``/metrics`` before and after: ``vllm:prompt_tokens_by_source_total{source="..."}`` (vLLM's
  attribution of prompt tokens, CacheHitSource: the P2P tier's pulls count under its own source), and
  ``vllm:external_prefix_cache_hits_total``;
* the router's ``bidikv_router_host_tier_asks_total`` and ``bidikv_router_turns_by_tier_total``.

It passes when the second turn's tier is ``host`` and P's P2P-sourced prompt tokens grew. What was not
run before the GPU (impl/connector/two_tier.py, docs/guides/host-tier.md): the GPU<->host copies of
vLLM's offloading worker, and the three vLLM servers together.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from typing import Any

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)')


def metrics(url: str, prefix: str) -> dict[str, float]:
    """Prometheus samples of ``url`` whose names start with ``prefix``, summed by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"].startswith(prefix):
            key = m["name"] + (m["labels"] or "")
            out[key] = out.get(key, 0.0) + float(m["value"])
    return out


def chat(router: str, model: str, messages: list[dict[str, str]], conversation: str) -> tuple[str, dict[str, str]]:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 32, "temperature": 0,
                       "conversation_id": conversation}).encode()
    req = urllib.request.Request(f"{router}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        obj = json.load(r)
        return obj["choices"][0]["message"]["content"], dict(r.headers)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="the router's base URL")
    parser.add_argument("--prefill", required=True, help="P's base URL (its /metrics)")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--gap", type=float, required=True, help="seconds between the turns: longer than D's TTL")
    parser.add_argument("--prompt-words", type=int, default=3000,
                        help="length of the first question (the pull must reach the router's minimum in tokens)")
    args = parser.parse_args(argv)

    conversation = f"host-tier-check-{int(time.time())}"
    first = [{"role": "user", "content": f"[{conversation}] " + " ".join(f"word{i}" for i in range(args.prompt_words))
              + "\nSummarise the list above."}]
    answer, _ = chat(args.router, args.model, first, conversation)
    print(f"turn 1 done ({len(answer)} characters); waiting {args.gap:g} s for D's HBM copy to expire")
    time.sleep(args.gap)
    p_before = metrics(f"{args.prefill}/metrics", "vllm:")
    r_before = metrics(f"{args.router}/metrics", "bidikv_router_")
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the last word?"}]
    _, headers = chat(args.router, args.model, second, conversation)
    p_moved = delta(p_before, metrics(f"{args.prefill}/metrics", "vllm:"))
    r_moved = delta(r_before, metrics(f"{args.router}/metrics", "bidikv_router_"))
    tier = headers.get("X-Bidikv-Reuse-Tier")
    print(f"turn 2: X-Bidikv-Reuse-Tier={tier} X-Bidikv-Prefill-Cached-Tokens={headers.get('X-Bidikv-Prefill-Cached-Tokens')}")
    for name, moved in (("P", p_moved), ("router", r_moved)):
        for key in sorted(k for k in moved if "by_source" in k or "host_tier" in k or "by_tier" in k
                          or "external_prefix_cache" in k):
            print(f"  {name} {key} +{moved[key]:g}")
    pulled = sum(v for k, v in p_moved.items() if "prompt_tokens_by_source" in k and "p2p" in k.lower())
    ok = tier == "host" and pulled > 0
    print("PASS: P pulled the turn from D's host tier" if ok else
          "FAIL: see docs/guides/host-tier.md, 'When nothing is pulled'")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
