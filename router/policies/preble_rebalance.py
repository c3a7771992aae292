"""Preble E2's background passes, run from `PrebleE2.on_tick`: post-assignment load rebalancing (specs/preble.md
§5.4, the code's `handle_important_node_stealing`) and hot-prefix replication (§5.5).

`plan_rebalance` is pure planning (which key-portion nodes to redirect from the heaviest worker to the lightest
so that max L no longer exceeds Th_bal × min L); `rebalance` applies it as a redirect table on the node plus load
transferred within H. Running or waiting requests never move.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from switchyard.router.policies.preble_load import NodeStats, is_overloaded

if TYPE_CHECKING:
    from switchyard.router.policies.preble_e2 import PrebleE2

log = logging.getLogger("switchyard.router.policies.preble_e2")  # one logger for the policy's DEBUG lines


def node_loads(p: PrebleE2, worker: str, now: float, only: Any = None) -> dict[int, list[Any]]:
    """id(key node) -> [node, requests in H, Σ (PT_r + DT_worker) s] over the worker's history: each key node's
    share of L. Key nodes are resolved in the current tree (a split since dispatch may have moved them). `only`:
    that key node's slot alone (replication splits one node's cost), with `key_of_record` asked only of the entries
    whose prompt has its first block at its place (a necessary condition), not of the whole history; the same
    entries in the same order, so the same float."""
    hist = p.history.get(worker)  # type: ignore[call-overload]
    if hist is None:
        return {}
    dt = hist.decode_time_s(now, p.cost_model(worker), p.cfg.decode_pricing == "marginal")  # type: ignore[arg-type]
    cutoff = now - p.cfg.history_window_s
    at, first = (only.context_blocks, only.first_block) if only is not None else (0, None)
    acc: dict[int, list[Any]] = {}
    for e in hist.entries:
        h = e.block_hashes
        if e.t < cutoff or (only is not None and (len(h) <= at or h[at] != first)):
            continue
        key = p.key_of_record(e)
        if key is None or (only is not None and key is not only):
            continue
        slot = acc.get(id(key))
        if slot is None:
            acc[id(key)] = [key, 1, e.prefill_s + dt]
        else:
            slot[1] += 1
            slot[2] += e.prefill_s + dt
    return acc


def node_costs(p: PrebleE2, heavy: str, now: float) -> list[tuple[float, Any]]:
    """(cost s, key node) for the heavy worker's key nodes with >= `rebalance_min_node_requests` requests in H
    and no live redirect away from it, cheapest first."""
    out = []
    for node, count, cost in node_loads(p, heavy, now).values():
        st = node.stats
        if count < p.cfg.rebalance_min_node_requests or not isinstance(st, NodeStats):
            continue
        redirect = st.redirect.get(heavy)
        if redirect is not None and redirect[1] >= now:
            continue
        out.append((cost, node))
    out.sort(key=lambda cn: (cn[0], cn[1].context_blocks, cn[1].first_block))
    return out


def plan_rebalance(p: PrebleE2, loads: dict[str, float], now: float) -> list[tuple[str, str, Any, float]]:
    """[(heavy, light, key node, moved s)]: REBALANCE(list) of §5.4, iterated instead of recursed.

    Only with >= `rebalance_min_requests_per_worker` × workers requests in H. While max L > Th_bal × min L, move the
    heavy worker's cheapest key nodes to the lightest without overshooting (stop once L_h − c < L_l + c) and until
    L_h < Th_bal × L_l; then the next-heaviest against the updated lightest. A heavy worker with a single candidate
    node is left to replication (§5.5), as in the code.
    """
    cfg = p.cfg
    total = sum(p.history[w].live_sums(now)[0] for w in loads if w in p.history)  # type: ignore[index]
    if total < cfg.rebalance_min_requests_per_worker * len(loads):
        return []
    lst = sorted(loads.items(), key=lambda x: (-x[1], x[0]))
    out: list[tuple[str, str, Any, float]] = []
    while len(lst) > 1:
        (heavy, lh), (light, ll) = lst[0], lst[-1]
        if lh <= cfg.rebalance_threshold * ll:
            break
        costs = node_costs(p, heavy, now)
        if len(costs) >= 2:
            for c, node in costs:
                if lh - c < ll + c:
                    break  # would overshoot
                lh, ll = lh - c, ll + c
                out.append((heavy, light, node, c))
                if lh < cfg.rebalance_threshold * ll:
                    break
        lst[-1] = (light, ll)
        lst = sorted(lst[1:], key=lambda x: (-x[1], x[0]))
    return out


def rebalance(p: PrebleE2, model: str, now: float) -> None:
    """Apply `plan_rebalance` for one model: a redirect heavy -> light on each moved key node (for H), and the
    moved load transferred in L (as the code moves the node's windowed cost), so the next pass sees it."""
    workers = p.routable(model)
    if len(workers) < 2:
        return
    loads = {w.worker_id: p.load_s(w.worker_id, now) for w in workers}
    for heavy, light, node, moved_s in plan_rebalance(p, loads, now):
        node.stats.redirect[heavy] = (light, now + p.cfg.history_window_s)
        p.moved_load.add(now, heavy, -moved_s)
        p.moved_load.add(now, light, moved_s)
        p.num_redirects += 1
        log.debug("e2 rebalance: key node %r %s -> %s, moved %.3f s of L", node, heavy, light, moved_s)


def maybe_replicate(p: PrebleE2, now: float) -> None:
    """§5.5 autoscaling over the (key node, worker) pairs with new TTFT samples: when the node's mean TTFT on the
    worker doubled over H (`is_overloaded`), add a replica on the lightest routable worker not serving the node
    (if lighter), move half the node's cost there, and restart the detector."""
    dirty, p.dirty_ttft = p.dirty_ttft, {}
    window = p.cfg.history_window_s
    for (_, heavy), node in dirty.items():  # insertion order: deterministic
        st = node.stats
        if not isinstance(st, NodeStats) or heavy not in st.ttft:
            continue
        if not is_overloaded(st.ttft[heavy], now, window, p.cfg.replication_ttft_factor):
            continue
        pool = next((ws for ws in (p.routable(m) for m in sorted(p._models)) if any(w.worker_id == heavy for w in ws)), [])
        serving = {heavy} | {r for r, until in st.replicas.items() if until >= now} | set(node.resident) | node.assigned
        others = [w.worker_id for w in pool if w.worker_id not in serving]
        if not others:
            continue
        light = min(others, key=lambda w: (p.load_s(w, now), w))
        if p.load_s(light, now) >= p.load_s(heavy, now):  # type: ignore[arg-type]
            continue
        st.replicas[light] = now + window
        st.ttft[heavy].clear()  # the detector restarts (the code resets (n, heavy))
        half = node_loads(p, heavy, now, only=node).get(id(node), [None, 0, 0.0])[2] / 2  # the code splits its cost
        p.moved_load.add(now, heavy, -half)
        p.moved_load.add(now, light, half)
        p.num_replications += 1
        log.debug("e2 replicate: key node %r hot on %s (TTFT doubled over H): replica on %s", node, heavy, light)
