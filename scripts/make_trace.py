"""Write a Mooncake-format trace from a generative process of multi-turn chat sessions.

A second trace for ``scripts/bench_trace.py`` (issue 35) that is not the Mooncake synthetic
one: sessions arrive as a Poisson process; each opens with one of ``--prompts`` system prompts
(Zipf popularity, 2-12 blocks) and, with probability ``--doc-share``, one of ``--docs`` shared
documents (Zipf, 8-96 blocks), then a user message; it runs a geometric number of turns
(mean ``--turns``), each after an exponential think time, and each turn's prompt is the
previous one plus the answer and a new message. Block ids are prefix hashes (one id per
distinct prefix, numbered in order of first appearance); a prompt's last block is partial,
so its id is new in every request, as in Mooncake's traces.

Run: ``python scripts/make_trace.py --seed 1 --out /tmp/chat_trace.jsonl``.
"""

from __future__ import annotations

import argparse
import heapq
import json

import numpy as np


def zipf_pick(rng: np.random.Generator, n: int, s: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=w / w.sum()))


def generate(a: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(a.seed)
    ids: dict[tuple[int, int], int] = {}  # (parent id, content) -> block id
    fresh = iter(range(1, 1 << 62))

    def extend(chain: list[int], contents: list[int]) -> list[int]:
        out = list(chain)
        parent = out[-1] if out else 0
        for c in contents:
            parent = ids.setdefault((parent, c), next(fresh))
            out.append(parent)
        return out

    def new_content(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1 << 40, 1 << 62, size=n)]

    prompts = [new_content(int(rng.integers(2, 13))) for _ in range(a.prompts)]
    docs = [new_content(int(rng.integers(8, 97))) for _ in range(a.docs)]
    events: list[tuple[float, int, list[int], int]] = []  # time, seq, full blocks, turns left
    t = 0.0
    seq = 0
    out: list[dict] = []
    while len(out) < a.requests:
        t += float(rng.exponential(a.session_gap_ms))
        start = prompts[zipf_pick(rng, a.prompts, 1.1)]
        if rng.random() < a.doc_share:
            start = start + docs[zipf_pick(rng, a.docs, 0.9)]
        chain = extend([], start + new_content(int(rng.integers(1, 5))))
        turns = int(rng.geometric(1.0 / a.turns))
        heapq.heappush(events, (t, seq, chain, turns))
        seq += 1
        while events and events[0][0] <= t and len(out) < a.requests:
            when, _, chain, left = heapq.heappop(events)
            partial = next(fresh)  # the last, partial block: new in every request
            out.append(
                {
                    "timestamp": int(when),
                    "input_length": 512 * len(chain) + int(rng.integers(1, 512)),
                    "output_length": int(rng.integers(16, 1024)),
                    "hash_ids": [*chain, partial],
                }
            )
            if left > 1:
                grown = extend(chain, new_content(int(rng.integers(2, 7))))
                think = float(rng.exponential(a.think_ms))
                heapq.heappush(events, (when + think, seq, grown, left - 1))
                seq += 1
    # renumber ids densely in order of first appearance, as Mooncake's remapped hashes are
    remap: dict[int, int] = {}
    for r in out:
        r["hash_ids"] = [remap.setdefault(x, len(remap)) for x in r["hash_ids"]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--prompts", type=int, default=40, help="system prompts")
    p.add_argument("--docs", type=int, default=400, help="shared documents")
    p.add_argument("--doc-share", type=float, default=0.5)
    p.add_argument("--turns", type=float, default=3.0, help="mean turns a session")
    p.add_argument("--session-gap-ms", type=float, default=400.0)
    p.add_argument("--think-ms", type=float, default=60_000.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    reqs = generate(a)
    with open(a.out, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    n = sum(len(r["hash_ids"]) for r in reqs)
    distinct = len({x for r in reqs for x in r["hash_ids"]})
    print(f"{len(reqs)} requests, {n} block references, {distinct} distinct -> {a.out}")


if __name__ == "__main__":
    main()
