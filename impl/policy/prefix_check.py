"""Token-exact reuse: pull a peer's KV only for the prefix where its token ids equal the prompt's.

Why a message-level check is not enough: D holds KV for the token ids it *generated*; the next
prompt holds the ids the tokenizer makes of the *detokenized* text, re-rendered by the chat
template. For a byte-level BPE with merges the generated split is often not the canonical one, a
template with ``| trim`` changes the answer's first token, reasoning templates drop earlier thinking
(vLLM #43094, https://github.com/vllm-project/vllm/issues/43094). Equal messages do not mean equal
tokens, so the reader (P) must compare token ids, where the tokens are.

The scheme, compact enough to ride in ``kv_transfer_params`` every turn:

* The holder publishes *checkpoints*: for a few prefix lengths ``k`` (in blocks) a short digest of
  the chained hash of block ``k - 1``. The chain is vLLM's own ``Request.block_hashes`` in the
  connector (each block's hash covers its parent's, so it covers every earlier token, plus the
  ``cache_salt``), and :func:`chain_block_hashes` in tests and in the simulator's model of it. The
  digest also covers a *scheme* tag (hash algorithm, seed, block size, model), so peers that would
  hash differently never agree by accident: they disagree and nothing is pulled.
* Checkpoints are dense at the end of what the holder has (the last ``dense`` blocks) and geometric
  further back, and geometric both ways from *anchors* (the holder's prompt end: a previous answer
  drifts a few tokens in, and a template that re-renders it, e.g. drops a reasoning opener the
  generation prompt added, differs just before it). A digest over the partial last block (the *tail*)
  makes an undiverged continuation verify to the token.
* The reader computes the same digests over its prompt (a dozen hashes of vLLM's existing block
  hashes: constant work per turn, see ``benchmarks/prefix_check_cost.py``) and takes the longest
  checkpoint that agrees. Agreement is monotone in the prefix, so nothing between checkpoints can
  agree after a disagreement; a false agreement needs a 64-bit digest collision of a chained hash.

What a sparse scheme can lose (:func:`lost_blocks_bound`): with ``n`` blocks held and the first
disagreeing block at index ``d`` (so ``d`` blocks agree), the reader verifies ``c <= d`` blocks with
``d - c <= max(0, n - d - dense)``; and when ``d`` lies at or after an anchor ``a``,
``2 * (d - c) < d - a`` (at least half of what agrees past the anchor is kept) or ``c == d``; when
``d`` lies before an anchor, ``d - c < a - d``. Checkpoints number at most ``dense + 3 log2(n) + 4``.

Pure: standard library only, no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

CHECK_KEY = "bidikv_prefix_check"  # in kv_transfer_params: the holder's checkpoints
REPORT_KEY = "bidikv_reuse"  # in P's returned kv_transfer_params: what P offered / verified / pulled
SCHEME_VERSION = 1
DEFAULT_DENSE_BLOCKS = 8
DIGEST_BYTES = 8
MAX_CHECKPOINTS = 256  # a published check with more is malformed (bounded work for the reader)


class VerifyReason(enum.Enum):
    FULL = "full"  # every token the peer holds that the prompt also has is verified equal
    # a shorter prefix is verified: the sequences diverge after it, or (within the bound of
    # lost_blocks_bound) checkpoints are too sparse to tell exactly where, or the prompt ends inside
    # the holder's last partial block; either way the rest is recomputed
    PARTIAL = "partial"
    NO_CHECK = "no_check"  # the peer published no checkpoints (not a bidikv connector, or an old one)
    SCHEME = "scheme"  # the peer hashes differently (algorithm, seed, block size or model): nothing comparable
    MALFORMED = "malformed"  # the published check is not what this module writes


@dataclass(frozen=True, slots=True)
class PrefixVerification:
    tokens: int  # leading tokens of the peer's sequence verified equal to the reader's
    reason: VerifyReason


def scheme_tag(*parts: str | int | bytes) -> str:
    """A short fingerprint of everything that must be equal for two chains to be comparable."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"bidikv-scheme")
    h.update(str(SCHEME_VERSION).encode())
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.hexdigest()


def chain_block_hashes(token_ids: Sequence[int], block_size: int, seed: bytes = b"") -> list[bytes]:
    """Chained hashes of every full block: the same monotone property as vLLM's block hashes.

    Used where vLLM's are not at hand (tests, the reference for the simulator's model).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[bytes] = []
    parent = hashlib.blake2b(seed, digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block_size}q", *block), digest_size=16).digest()
        out.append(parent)
    return out


def checkpoint_blocks(num_blocks: int, anchors: Iterable[int] = (), dense: int = DEFAULT_DENSE_BLOCKS) -> list[int]:
    """Prefix lengths (in blocks, each in ``1..num_blocks``) to publish digests for, descending."""
    if num_blocks <= 0:
        return []
    dense = max(1, dense)
    points = set(range(max(1, num_blocks - dense + 1), num_blocks + 1))
    step = 1
    while num_blocks - dense + 1 - step >= 1:
        points.add(num_blocks - dense + 1 - step)
        step *= 2
    for anchor in anchors:
        if 1 <= anchor <= num_blocks:
            points.add(anchor)
            step = 1
            while anchor + step < num_blocks or anchor - step >= 1:
                if anchor + step < num_blocks:
                    points.add(anchor + step)
                if anchor - step >= 1:
                    points.add(anchor - step)
                step *= 2
    return sorted(points, reverse=True)


def verified_blocks(agreeing_blocks: int, checkpoints: Iterable[int]) -> int:
    """The reader's verified prefix, in blocks, when exactly ``agreeing_blocks`` leading blocks agree.

    The largest checkpoint not beyond the first disagreement (0 if none): what :func:`verify_prefix`
    finds with real hashes, and what the simulator charges without them.
    """
    return max((c for c in checkpoints if c <= agreeing_blocks), default=0)


def verified_tokens_model(held_tokens: int, held_prompt_tokens: int, agreeing_tokens: int, prompt_tokens: int,
                          block_size: int, dense: int = DEFAULT_DENSE_BLOCKS) -> int:
    """Tokens the reader verifies, from counts alone (the simulator's model of :func:`verify_prefix`).

    The holder holds ``held_tokens`` (its prompt was ``held_prompt_tokens``: the anchor), of which
    the first ``agreeing_tokens`` equal the reader's prompt of ``prompt_tokens``. Exactly what the
    hash-based check finds (property-tested against it), so simulated and real reuse agree.
    """
    # max(0, min(agreeing_tokens, held_tokens, prompt_tokens)), written out: the builtins' argument
    # handling costs more than the comparisons (the simulator calls this once per turn)
    agree = held_tokens if held_tokens < agreeing_tokens else agreeing_tokens
    if prompt_tokens < agree:
        agree = prompt_tokens
    if agree <= 0:
        agree = 0
    if agree == held_tokens and prompt_tokens >= held_tokens:
        return held_tokens  # the tail digest verifies a faithful continuation to the token
    points = checkpoint_blocks(held_tokens // block_size, [held_prompt_tokens // block_size], dense)
    return verified_blocks(agree // block_size, points) * block_size


def lost_blocks_bound(num_blocks: int, agreeing_blocks: int, anchors: Iterable[int] = (),
                      dense: int = DEFAULT_DENSE_BLOCKS) -> int:
    """An upper bound on ``agreeing_blocks - verified_blocks(...)`` (see the module docstring)."""
    d = min(agreeing_blocks, num_blocks)
    bound = max(0, num_blocks - d - max(1, dense))
    for anchor in anchors:
        if 1 <= anchor <= d:
            bound = min(bound, max(0, (d - anchor - 1) // 2))
        elif d < anchor <= num_blocks:
            bound = min(bound, max(0, anchor - d - 1))
    return bound


def _digest(scheme: str, block_hash: bytes, tail: bytes = b"") -> str:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"bidikv-prefix")
    h.update(scheme.encode("ascii"))
    h.update(bytes(block_hash))
    if tail:
        h.update(b"T")
        h.update(tail)
    return h.hexdigest()


def _tail_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def publish(chain: Sequence[bytes], token_ids: Sequence[int], num_tokens: int, *, scheme: str, block_size: int,
            anchor_tokens: Iterable[int] = (), dense: int = DEFAULT_DENSE_BLOCKS) -> dict[str, Any] | None:
    """The holder's check over its first ``num_tokens`` tokens (JSON-ready), or None if it cannot tell.

    ``chain`` holds the chained hashes of the holder's full blocks (at least ``num_tokens //
    block_size`` of them), ``token_ids`` the holder's tokens (only the partial last block is read).
    """
    full = num_tokens // block_size
    if num_tokens <= 0 or block_size < 1 or len(chain) < full or len(token_ids) < num_tokens:
        return None
    anchors = [a // block_size for a in anchor_tokens]
    points = checkpoint_blocks(full, anchors, dense)[:MAX_CHECKPOINTS]
    check: dict[str, Any] = {"v": SCHEME_VERSION, "scheme": scheme, "bs": block_size, "n": num_tokens,
                             "cp": [[k, _digest(scheme, chain[k - 1])] for k in points]}
    if num_tokens > full * block_size:
        check["tail"] = _digest(scheme, chain[full - 1] if full else b"", _tail_bytes(token_ids[full * block_size:num_tokens]))
    return check


def _parse(check: Any, block_size: int) -> tuple[int, list[tuple[int, str]], str | None] | None:
    if not isinstance(check, Mapping) or check.get("v") != SCHEME_VERSION:
        return None
    n, bs, cps, tail = check.get("n"), check.get("bs"), check.get("cp"), check.get("tail")
    if type(n) is not int or n < 0 or type(bs) is not int or bs != block_size:
        return None
    if not isinstance(cps, list) or len(cps) > MAX_CHECKPOINTS or (tail is not None and not isinstance(tail, str)):
        return None
    points = []
    for cp in cps:
        if (not isinstance(cp, list) or len(cp) != 2 or type(cp[0]) is not int or not 1 <= cp[0] <= n // bs
                or not isinstance(cp[1], str)):
            return None
        points.append((cp[0], cp[1]))
    return n, points, tail


def verify_prefix(check: Any, chain: Sequence[bytes], token_ids: Sequence[int], *, scheme: str,
                  block_size: int) -> PrefixVerification:
    """How many leading tokens of the holder's sequence the reader's prompt provably shares.

    ``chain``: the reader's chained block hashes over its prompt; ``token_ids``: its prompt's ids
    (only a partial block's worth is read, for the tail). Never more than the prompt's length.
    """
    if check is None:
        return PrefixVerification(0, VerifyReason.NO_CHECK)
    if isinstance(check, Mapping) and check.get("v") == SCHEME_VERSION and check.get("scheme") != scheme:
        return PrefixVerification(0, VerifyReason.SCHEME)
    if isinstance(check, Mapping) and check.get("v") == SCHEME_VERSION and check.get("bs") != block_size:
        return PrefixVerification(0, VerifyReason.SCHEME)
    parsed = _parse(check, block_size)
    if parsed is None:
        return PrefixVerification(0, VerifyReason.MALFORMED)
    num_tokens, points, tail = parsed
    full = num_tokens // block_size
    best = 0
    for k, digest in points:
        if best < k <= len(chain) and _digest(scheme, chain[k - 1]) == digest:
            best = k
    tokens = best * block_size
    if best == full and num_tokens > tokens and len(token_ids) >= num_tokens and tail is not None:
        ours = _digest(scheme, chain[full - 1] if full else b"", _tail_bytes(token_ids[tokens:num_tokens]))
        if ours == tail:
            tokens = num_tokens
    comparable = min(num_tokens, len(token_ids))
    return PrefixVerification(tokens, VerifyReason.FULL if tokens >= comparable else VerifyReason.PARTIAL)
