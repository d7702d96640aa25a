#!/usr/bin/env python3
"""A mutation check we keep, because tests once passed with these bugs in: one-line bugs over impl/policy and the router's
store/guard/expiry path, each applied alone to a temporary copy of the tree, each followed by the fast
test files that should notice. A mutant the tests do not kill is a *survivor*.

Every mutant is an exact text replacement that must match exactly once in its file; when someone
edits the line, the mutant is reported *stale* (update it here) rather than silently skipped. A
mutant whose survival is accepted carries the reason in ``survives``; any other survivor, and any
stale mutant, makes the script exit 1.

    .venv/bin/python tools/mutants.py                 # all mutants, a table at the end
    .venv/bin/python tools/mutants.py --list          # names only
    .venv/bin/python tools/mutants.py store-lru-fifo gap-quantile-round   # some of them
    git archive HEAD | tar -x -C /tmp/head && .venv/bin/python tools/mutants.py --tree /tmp/head  # committed code

The copy holds impl/, sim/, calibration/, tests/ and pyproject.toml; imports come from the copy
(``PYTHONPATH`` and the working directory, checked before the first mutant), bytecode is never
written (a mutated file of the same size and second must not reuse a stale .pyc), and the unmutated
copy must pass every selected test file first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPY = ("impl", "sim", "calibration", "tests", "pyproject.toml")

POLICY = ("tests/policy",)
STORE_BYTES = ("tests/router/test_store_bytes.py",)  # the byte bound's own tests
ROUTER = ("tests/policy/test_store.py", "tests/router/test_flow.py", "tests/router/test_heartbeat.py",
          "tests/router/test_faults.py", "tests/router/test_units.py", "tests/router/test_load_and_state.py",
          "tests/router/test_clocks.py", "tests/router/test_guard_answer.py", "tests/router/test_recorder_stores.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    find: str  # must occur exactly once in the file
    replace: str
    tests: tuple[str, ...]
    survives: str | None = None  # why surviving is acceptable (an equivalent mutant), if it is


MUTANTS = [
    # -- impl/policy/store.py ---------------------------------------------------------------------
    Mutant("store-lru-fifo", "impl/policy/store.py",  # survived every test before its test was written
           "        self._entries.move_to_end(key)\n        self.stats.hits += 1",
           "        self.stats.hits += 1", POLICY),
    Mutant("store-purge-current-bucket", "impl/policy/store.py",  # survived every test before its test was written
           "upto = self._bucket(now)  #", "upto = self._bucket(now) + 1  #", POLICY),
    Mutant("store-no-margin", "impl/policy/store.py",
           "    return expires_at - margin_s", "    return expires_at", POLICY),
    Mutant("store-usable-at-its-end", "impl/policy/store.py",
           "        if now >= usable_until(entry.expires_at, self.expiry_margin_s):\n            return self._miss(MissReason.EXPIRED)",
           "        if now > usable_until(entry.expires_at, self.expiry_margin_s):\n            return self._miss(MissReason.EXPIRED)", POLICY),
    Mutant("store-any-tenant", "impl/policy/store.py",
           "        entry = self._entries.get(key)\n        if entry is None:\n            # another",
           "        entry = self._entries.get(key) or next((e for k, e in self._entries.items() if k[1] == conversation_id), None)\n"
           "        if entry is None:\n            # another", POLICY),
    Mutant("store-evict-newest", "impl/policy/store.py",
           "old_key = next(iter(self._entries))", "old_key = next(reversed(self._entries))", POLICY),
    Mutant("store-bound-off-by-one", "impl/policy/store.py",
           "while len(self._entries) > self.max_entries or", "while len(self._entries) >= self.max_entries or", POLICY),
    Mutant("store-bytes-leak-on-remove", "impl/policy/store.py",
           "self._bytes -= self._sizes.pop(key, 0)", "self._sizes.pop(key, 0)", POLICY + STORE_BYTES),
    Mutant("store-byte-bound-doubled", "impl/policy/store.py",
           "self.max_bytes is not None and self.bytes > self.max_bytes", "self.max_bytes is not None and self.bytes > 2 * self.max_bytes",
           POLICY + STORE_BYTES),
    Mutant("store-keeps-born-expired", "impl/policy/store.py",
           "        if now >= until:  # born expired", "        if now > until + 1.0:  # born expired",
           POLICY),
    Mutant("store-replace-keeps-old-bookkeeping", "impl/policy/store.py",
           "                self._unbook(key)\n                if unbounded:", "                if unbounded:", POLICY),
    Mutant("store-replace-unsized-keeps-old-wheel-slot", "impl/policy/store.py",
           "                bucket = self._wheel[self._bucket_of[key]]\n                del bucket[key]\n",
           "                bucket = self._wheel[self._bucket_of[key]]\n", POLICY),
    Mutant("store-purge-nothing", "impl/policy/store.py",
           "        for b in indices:\n", "        for b in indices[:0]:\n", POLICY),
    Mutant("store-purge-skips-a-bucket", "impl/policy/store.py",
           "range(int(self._swept_below), upto)", "range(int(self._swept_below) + 1, upto)", POLICY),
    # -- impl/policy/continuation.py, text_prompt.py ------------------------------------------------
    Mutant("guard-no-digest", "impl/policy/continuation.py",
           "return held_len <= prompt.length and prompt.prefix_digest(held_len) == held_digest",
           "return held_len <= prompt.length", POLICY),
    Mutant("guard-strictly-longer", "impl/policy/continuation.py",
           "return held_len <= prompt.length and", "return held_len < prompt.length and", POLICY),
    Mutant("digest-no-length-prefix", "impl/policy/continuation.py",
           "        h.update(len(data).to_bytes(4, \"little\"))\n", "", POLICY),
    Mutant("digest-no-type-tag", "impl/policy/continuation.py",
           "        h.update(b\"s\" if isinstance(item, str) else b\"i\")\n", "", POLICY),
    Mutant("canonical-fast-path-key-order", "impl/policy/continuation.py",
           "out.append('{\"content\":' + _encode_str(message[\"content\"]) + ',\"role\":' + _encode_str(message[\"role\"]) + \"}\")",
           "out.append('{\"role\":' + _encode_str(message[\"role\"]) + ',\"content\":' + _encode_str(message[\"content\"]) + \"}\")",
           POLICY),
    Mutant("text-digest-untagged", "impl/policy/text_prompt.py",
           "return sequence_digest((TEXT_ITEM_TAG, self.text[:n]))", "return sequence_digest((self.text[:n],))", POLICY),
    # -- impl/policy/retention.py -----------------------------------------------------------------
    Mutant("gap-quantile-round", "impl/policy/retention.py",  # survived every test before its test was written
           "rank = max(1, math.ceil(self.quantile * n))", "rank = max(1, round(self.quantile * n))", POLICY),
    Mutant("gap-quantile-drops-smallest", "impl/policy/retention.py",
           "del self._sorted[bisect.bisect_left(self._sorted, oldest)]", "del self._sorted[0]", POLICY),
    Mutant("gap-quantile-no-margin", "impl/policy/retention.py",
           "self._sorted[rank - 1] + self.margin_s", "self._sorted[rank - 1]", POLICY),
    Mutant("gap-quantile-window-plus-one", "impl/policy/retention.py",
           "if len(self._fifo) == self.window:", "if len(self._fifo) > self.window:", POLICY),
    Mutant("gap-quantile-min-samples-off-by-one", "impl/policy/retention.py",
           "if n < self.min_samples:", "if n <= self.min_samples:", POLICY),
    Mutant("lease-revives-lapsed", "impl/policy/retention.py",
           "if now > current_expiry:  #", "if now > current_expiry + self.lease_s:  #", POLICY),
    Mutant("lease-uncapped", "impl/policy/retention.py",
           "min(now + self.lease_s, finished_at + self.max_hold_s)", "now + self.lease_s", POLICY),
    Mutant("fixed-ttl-renews", "impl/policy/retention.py",
           "        return current_expiry\n\n    def observe_gap(self, gap_s: float) -> None:\n        return None\n\n\n"
           "@dataclass(frozen=True, slots=True)\nclass HeartbeatLease",
           "        return max(current_expiry, now + self.seconds)\n\n    def observe_gap(self, gap_s: float) -> None:\n"
           "        return None\n\n\n@dataclass(frozen=True, slots=True)\nclass HeartbeatLease", POLICY),
    # -- impl/policy/recompute.py -----------------------------------------------------------------
    Mutant("threshold-strict", "impl/policy/recompute.py",
           "if count >= self.tokens:", "if count > self.tokens:", POLICY),
    Mutant("local-hit-unaligned", "impl/policy/recompute.py",
           "return (self.local_hit_tokens // self.block_size) * self.block_size", "return self.local_hit_tokens",
           POLICY),
    Mutant("reusable-local-hit-unaligned", "impl/policy/recompute.py",
           "- self.local_hit_tokens // block * block", "- self.local_hit_tokens", POLICY),
    Mutant("reusable-ignores-prompt", "impl/policy/recompute.py",
           "return min(self.remote_num_tokens, self.prompt_tokens) - self.local_hit_tokens",
           "return self.remote_num_tokens - self.local_hit_tokens", POLICY),
    Mutant("break-even-ties-pull", "impl/policy/recompute.py",
           "        pull = pull_s < recompute_s\n", "        pull = pull_s <= recompute_s\n", POLICY),
    Mutant("peer-span-rounds-down", "impl/policy/recompute.py",
           "stop = -(-(self.aligned_local_hit + tokens) // self.block_size)",
           "stop = (self.aligned_local_hit + tokens) // self.block_size", POLICY),
    # -- impl/policy/pressure.py ------------------------------------------------------------------
    Mutant("victims-latest-expiry-first", "impl/policy/pressure.py",
           "return (holder.expires_at, -holder.blocks)", "return (-holder.expires_at, -holder.blocks)", POLICY),
    Mutant("victims-include-running", "impl/policy/pressure.py",
           "if not h.running and h.blocks > 0", "if h.blocks > 0", POLICY),
    Mutant("victims-drop-even-if-insufficient", "impl/policy/pressure.py",
           "            return VictimChoice(tuple(victims), freed, True)\n    return VictimChoice((), 0, False)",
           "            return VictimChoice(tuple(victims), freed, True)\n    return VictimChoice(tuple(victims), freed, False)",
           POLICY),
    Mutant("pool-expires-strictly-after", "impl/policy/pressure.py",
           "while self._heap and self._heap[0][0] <= now:", "while self._heap and self._heap[0][0] < now:", POLICY),
    # -- impl/policy/placement.py -----------------------------------------------------------------
    Mutant("placement-picks-unhealthy", "impl/policy/placement.py",
           "        if not inst.healthy:\n            continue", "        if False:\n            continue", POLICY),
    Mutant("kv-aware-min-reuse", "impl/policy/placement.py",
           "reused = max(request.cached_tokens.get(inst.name, 0), request.remote_reusable_tokens)",
           "reused = min(request.cached_tokens.get(inst.name, 0), request.remote_reusable_tokens)", POLICY),
    # -- the router's store / guard / expiry path -------------------------------------------------
    Mutant("router-expiry-from-d-clock-final-chunk", "impl/router/recorder.py",  # D's clock taken for ours
           "        else:\n            expires_at = finished_at + ttl\n",
           "        else:\n            expires_at = float(params.get(\"remote_blocks_expiry_time\") or finished_at + ttl)\n",
           ROUTER),
    Mutant("router-expiry-from-d-clock-notify", "impl/router/recorder.py",  # D's clock taken for ours
           "expires_at = min(finished_at + ttl, notification.received_at + notification.expires_in_s)",
           "expires_at = min(finished_at + ttl, float(notification.kv_params[\"remote_blocks_expiry_time\"]))",
           ROUTER),
    Mutant("router-expiry-trusts-longer", "impl/router/recorder.py",
           "expires_at = min(finished_at + ttl, notification.received_at + notification.expires_in_s)",
           "expires_at = max(finished_at + ttl, notification.received_at + notification.expires_in_s)", ROUTER),
    Mutant("heartbeat-expiry-from-d-clock", "impl/router/heartbeat.py",  # D's clock taken for ours, on the heartbeat path
           "expires_at = sent_at + answer[\"expires_in_s\"]", "expires_at = answer[\"expiry_time\"]", ROUTER),
    Mutant("heartbeat-gives-p-router-clock", "impl/router/heartbeat.py",
           "params[\"remote_blocks_expiry_time\"] = answer[\"expiry_time\"]",
           "params[\"remote_blocks_expiry_time\"] = expires_at", ROUTER),
    Mutant("heartbeat-expired-entry-relayed", "impl/router/heartbeat.py",
           "if entry is None or now >= entry.expires_at:", "if entry is None:", ROUTER),
    Mutant("router-one-tenant", "impl/router/proxy.py",
           "key = (tenant, turn.conversation_id) if turn.conversation_id is not None else None",
           "key = (\"\", turn.conversation_id) if turn.conversation_id is not None else None", ROUTER),
    Mutant("router-lookup-ignores-clock", "impl/router/proxy.py",
           "found = await self.store.lookup(tenant, key[1], turn.view, self.clock())",
           "found = await self.store.lookup(tenant, key[1], turn.view, 0.0)", ROUTER),
    Mutant("held-chat-without-answer", "impl/router/request.py",
           "items = list(self.view.items) + canonical_messages([{\"role\": \"assistant\", \"content\": answer}])",
           "items = list(self.view.items)", ROUTER),
    Mutant("held-text-without-answer", "impl/router/request.py",
           "return TextPrompt(self.body[\"prompt\"] + answer).full_digest()",
           "return TextPrompt(self.body[\"prompt\"]).full_digest()", ROUTER),
    Mutant("held-tokens-without-output", "impl/router/request.py",
           "items = list(self.body[\"prompt\"]) + list(output_token_ids)", "items = list(self.body[\"prompt\"])",
           ROUTER),
    Mutant("recorder-stores-incomplete-turns", "impl/router/recorder.py",
           "        if not capture.complete:\n", "        if False:\n", ROUTER),
    Mutant("recorder-stores-unreconstructable", "impl/router/recorder.py",
           "        elif capture.unreconstructable:\n", "        elif False:\n", ROUTER),
    Mutant("recorder-stores-unusable-params", "impl/router/recorder.py",
           "        if problem is not None:\n            self.metrics.turns_not_stored.inc(\"invalid_params\")",
           "        if False:\n            self.metrics.turns_not_stored.inc(\"invalid_params\")", ROUTER),
    Mutant("recorder-forwards-notify-secret", "impl/router/recorder.py",
           "        params.pop(NOTIFY_KEY, None)\n", "", ROUTER),
]


def copy_tree(source: Path, dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for name in COPY:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def environ(root: Path) -> dict[str, str]:
    # the CI profile's examples (derandomised: the same every run), without shrinking a failure
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE="mutants")
    return env


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'timeout', seconds, output tail)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=environ(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - t0, out[-2000:]
    return ("pass" if proc.returncode == 0 else "fail"), time.monotonic() - t0, out[-2000:]


def check_imports_from(root: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import impl.policy.store, impl.router.recorder as r; print(r.__file__)"],
                           cwd=root, env=environ(root), capture_output=True, text=True, timeout=120)
    where = probe.stdout.strip()
    if probe.returncode != 0 or not Path(where).resolve().is_relative_to(root.resolve()):
        sys.exit(f"the copy's modules are not the ones imported ({where!r}, {probe.stderr[-500:]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per test run (a hang counts as killed)")
    parser.add_argument("--tests", nargs="+", help="run these test files for every selected mutant instead of its own "
                                                    "list (e.g. to see whether one file alone kills a mutant)")
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="the source tree to copy (default: this checkout; e.g. a `git archive HEAD` export "
                             "to check the committed code while others edit the working tree)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45} {m.path}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    selected = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.tests:
        selected = [dataclasses.replace(m, tests=tuple(args.tests)) for m in selected]

    with tempfile.TemporaryDirectory(prefix="bidikv-mutants-") as tmp:
        root = Path(tmp)
        copy_tree(args.tree, root)
        check_imports_from(root)
        for tests in sorted({m.tests for m in selected}):
            present = tuple(t for t in tests if (root / t).exists())
            status, secs, out = run_tests(root, present, args.timeout)
            print(f"baseline {' '.join(present)}: {status} ({secs:.0f} s)", flush=True)
            if status != "pass":
                print(out)
                return 2
        rows = []
        for m in selected:
            path = root / m.path
            original = path.read_text()
            count = original.count(m.find)
            if count != 1:
                rows.append((m, "stale", 0.0, f"pattern found {count} times"))
                print(f"{m.name:45} stale ({count} matches)", flush=True)
                continue
            present = tuple(t for t in m.tests if (root / t).exists())
            path.write_text(original.replace(m.find, m.replace))
            try:
                status, secs, out = run_tests(root, present, args.timeout)
            finally:
                path.write_text(original)
            verdict = "survived" if status == "pass" else "killed"
            first_failure = next((line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), status)
            rows.append((m, verdict, secs, first_failure))
            print(f"{m.name:45} {verdict:8} {secs:5.0f} s  {first_failure[:110] if verdict == 'killed' else ''}",
                  flush=True)

    survivors = [(m, v) for m, v, _, _ in rows if v in ("survived", "stale")]
    killed = sum(1 for _, v, _, _ in rows if v == "killed")
    print(f"\n{killed} of {len(rows)} mutants killed")
    unexplained = 0
    for m, v in survivors:
        if v == "survived" and m.survives:
            print(f"  survived (accepted): {m.name}: {m.survives}")
        else:
            unexplained += 1
            print(f"  {v.upper()}: {m.name} ({m.path})")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
