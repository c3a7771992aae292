"""End to end: E2 routes a repeated prefix to the worker that holds it (real router and worker processes).

The router learns residency only from the workers' KV events, so the test first waits (polling the admin view,
with a bound) until the serving worker's blocks reached the router, then checks where the follow-ups go and that
the worker itself reports the prefix-cache hit.
"""

from __future__ import annotations

import random
import time

import pytest

from switchyard.bench import procs
from switchyard.router.client import RouterClient, make_request

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"
BLOCK = 16


def _wait_resident(client: RouterClient, worker_id: str, min_blocks: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(w.worker_id == worker_id and w.num_resident_blocks >= min_blocks for w in client.list_workers()):
            return
        time.sleep(0.02)
    raise AssertionError(f"router never saw {min_blocks} resident blocks on {worker_id}")


@pytest.mark.parametrize("policy", ["e2"])
def test_repeated_prefix_goes_to_the_worker_holding_it(policy: str) -> None:
    workers = [
        procs.start(f"w{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--time-scale", "0.01"])
        for i in range(3)
    ]
    args = ["serve", "--port", "0", "--admin-port", "0", "--no-metrics", "--policy", policy]
    for w in workers:
        args += ["--worker", w.address]
    router = procs.start("router", args)
    rng = random.Random(7)
    prefix = [1, *(rng.randrange(3, 32000) for _ in range(40 * BLOCK - 1))]  # 40 full blocks = 640 tokens
    with procs.running([*workers, router]), RouterClient(router.address, admin_address=router.extra["admin"]) as c:
        first = c.complete(request=make_request(MODEL, token_ids=prefix, max_tokens=2, ignore_eos=True))
        holder = first.timings.worker_id
        _wait_resident(c, holder, 40)
        for i in range(6):
            # 640 shared + 64 new tokens: cached (640) > missed (64), so E2 exploits the holder.
            suffix = [rng.randrange(3, 32000) for _ in range(4 * BLOCK)]
            resp = c.complete(request=make_request(MODEL, token_ids=prefix + suffix, max_tokens=2, ignore_eos=True))
            assert resp.timings.worker_id == holder, f"follow-up {i} went to {resp.timings.worker_id}"
            assert resp.usage.cached_prompt_tokens >= 40 * BLOCK  # the worker's own prefix cache hit
