"""What token-exact verification costs per turn, at conversation lengths up to 128k tokens.

Times, with vLLM's own block hasher (sha256, the default) producing the chain the connector reads:

* D publishing its checkpoints when a turn finishes (``impl.policy.prefix_check.publish``);
* P verifying them against its prompt (``verify_prefix``): a cost budgeted at 1 ms at 128k;
* the published check's size in ``kv_transfer_params`` (JSON bytes), what the router carries.

vLLM computes ``Request.block_hashes`` itself for every request once a KV connector is configured,
so the chain is not our cost; it is timed too, for scale.

    python benchmarks/prefix_check_cost.py [--tokens 1024 8192 32768 131072] [--repeat 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from impl.policy.prefix_check import publish, scheme_tag, verify_prefix  # noqa: E402


def vllm_chain(tokens: list[int], block_size: int) -> list[bytes]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    req = Request(request_id="bench", prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))
    return list(req.block_hashes)


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    scheme = scheme_tag("sha256", args.block_size, "bench-model", b"seed")
    vllm_chain(list(range(args.block_size)), args.block_size)  # import vLLM before timing anything
    print(f"load: {os.getloadavg()[0]:.2f} (1-min), block size {args.block_size}, median of {args.repeat}")
    print(f"{'tokens':>8} {'vLLM chain ms':>14} {'D publish us':>13} {'P verify us':>12} {'check bytes':>12}")
    for n in args.tokens:
        held = [(i * 7919) % 50_000 for i in range(n - 300)]  # D holds all but the next user message
        prompt = held[: n - 900] + [(held[n - 900] + 1) % 50_000] + held[n - 899:] + list(range(300))  # drifted
        t0 = time.perf_counter()
        held_chain = vllm_chain(held, args.block_size)
        chain_ms = (time.perf_counter() - t0) * 1e3
        prompt_chain = vllm_chain(prompt, args.block_size)
        check = publish(held_chain, held, len(held), scheme=scheme, block_size=args.block_size,
                        anchor_tokens=[len(held) - 600])
        wire = json.loads(json.dumps(check))
        pub = timed(lambda: publish(held_chain, held, len(held), scheme=scheme, block_size=args.block_size,
                                    anchor_tokens=[len(held) - 600]), args.repeat)
        ver = timed(lambda: verify_prefix(wire, prompt_chain, prompt, scheme=scheme, block_size=args.block_size),
                    args.repeat)
        result = verify_prefix(wire, prompt_chain, prompt, scheme=scheme, block_size=args.block_size)
        assert result.tokens <= n - 900, result
        print(f"{n:>8} {chain_ms:>14.1f} {pub * 1e6:>13.1f} {ver * 1e6:>12.1f} {len(json.dumps(check)):>12}")


if __name__ == "__main__":
    main()
