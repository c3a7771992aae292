"""Global prefix radix tree (Preble §4.1-4.3), keyed by chained KV block hashes: pure-Python reference.

CONTRACT (fixed; the E2 policy and the Cython twin `_radix_c.pyx` code against it):

Keys are the uint64 chained block hashes the router computes for a prompt (`RoutingContext.block_hashes`) and the
workers' KV events carry. Because hashes are chained (and already include model-side context: LoRA, cache salt),
one tree per model holds every context, and a hash identifies its whole prefix. Nodes hold runs of consecutive
blocks (path compression).

    tree = RadixTree(chained=False)            # chained=True: the caller promises every sequence is a chain of
                                               # uint64s (equal hashes at an offset mean equal prefixes); the C
                                               # build's walks then compare a node's last covered block first and
                                               # bisect on a mismatch: the reference's answers under the promise
                                               # (this build reads every block either way). `tree.chained` reads it
    path = tree.insert(block_hashes, now)      # match, then add the unmatched remainder as one new leaf;
                                               # splits a node when the match ends inside it; returns the
                                               # nodes root-exclusive from first to leaf (empty for no blocks);
                                               # touches last_access of every node on the path
    m = tree.match(block_hashes)               # read-only -> MatchResult:
        m.path: list[Node]                     #   nodes matched, first to last (the last may be partial)
        m.matched_blocks: int                  #   leading blocks present in the tree
        m.resident_blocks: dict[str, int]      #   per worker: leading blocks its KV events say it holds
        m.assigned_blocks: dict[str, int]      #   per worker: leading blocks the router assigned to it
        m.key_node: Node | None                #   Preble §3 key portion: the deepest node on the matched path
                                               #   with more blocks than all its predecessors together
                                               #   (num_blocks > context_blocks); None when nothing matched
    tree.assign(path, worker, now)             # optimistic: worker added to `assigned` on every node of path
    tree.unassign_worker(worker)               # drop a worker from every `assigned` and `evictions` set
    tree.note_evictions(node, worker) -> bool  # a BlockRemoved reached node's blocks on worker: if node is
                                               # assigned to worker, add worker to `evictions` and answer True
                                               # (E2 then adds those blocks to its evicted set for worker)
    tree.mark_resident(worker, block_hashes, parent_hash, now)
                                               # a BlockStored event: blocks unknown to the tree are inserted
                                               # under parent_hash (None = the root); if parent_hash is not in
                                               # the tree the event is ignored (a snapshot replays parents
                                               # first). Residency is a per-(node, worker) LEADING-RUN count:
                                               # a worker can only hit block k if blocks 0..k-1 are resident,
                                               # so the tree keeps `resident[worker] = d` (0 < d <= num_blocks)
                                               # = the node's first d blocks are resident; storing the block
                                               # right after the run extends it.
    tree.mark_evicted(worker, block_hashes)    # a BlockRemoved event: for a block at offset k of its node,
                                               # resident[worker] = min(d, k) (0 removes the entry): never
                                               # reports an evicted block as resident (conservative after).
    tree.clear_worker(worker)                  # AllBlocksCleared, or the worker's view is rebuilt
    tree.remove_worker(worker)                 # clear_worker + unassign_worker
    tree.gc(now, window_s, budget_blocks=None, removed_out=None, evicted=None)
                                               # Preble GC, "no caching GPU and no request in window W": removes
                                               # (repeatedly, in one post-order pass) every node with no children,
                                               # no resident worker and now - last_access > window_s. CHOICE:
                                               # `assigned` does not keep a node: it is optimistic, only
                                               # unassign_worker clears it, so an assignment with no request
                                               # touching the node for W and no KV event confirming it is stale
                                               # (else nothing ever routed would be collected). A removed node
                                               # is detached: is_attached False, parent None, assigned emptied.
                                               # Returns the number of nodes removed. With a budget, it
                                               # stops once the removed nodes hold that many blocks (which
                                               # dead nodes go first is build-specific; see gc). Appends
                                               # (blocks, assigned workers) per removed node with assigned
                                               # workers to removed_out, and drops its blocks from
                                               # evicted[w] (worker -> block-hash set) for each such worker.
    RadixTree.block_set() -> set-like          # an empty set of block hashes for `evicted` (the C build's
                                               # BlockSet: uint64 in C, pruned and read by gc/match_cached)
    tree.num_nodes -> int ; tree.num_blocks -> int
    tree.node_of(block_hash) -> tuple[Node, int] | None     # (node, offset) of a block
    tree.runs_of(block_hashes) -> list[tuple[Node, int, int]]
                                               # (node, i, j) per maximal run of positions i..j-1 whose
                                               # blocks lie in one node, in order; unknown blocks skipped
    tree.check_invariants()                    # for tests: parent/child links, block index, contexts
    tree.nodes() -> list[Node]                 # every node, pre-order (for tests, scans, autoscaling)
    RadixTree.key_node(path) -> Node | None    # the key-portion rule applied to any path (e.g. insert's)
    cached, best, path = tree.match_cached(block_hashes, workers, evicted)
                                               # read-only, E2's hot path in one call: per worker of `workers`
                                               # (an iterable of ids; the dict keeps its order), the leading
                                               # blocks it can serve = max(resident run, assigned run cut at the
                                               # first of those blocks found in evicted.get(worker): blocks its
                                               # KV events removed since the router assigned them), the
                                               # largest of those (0 for no workers), match(...).path
    node, end = tree.key_portion(path, upto, study)
                                               # Preble's key portion of `path` clipped to its first `upto`
                                               # blocks: "study" (§3, errata E5) = the deepest node with more
                                               # blocks than its predecessors together, else (Alg 1) the node
                                               # with the most blocks (the first such); (None, 0) when none

Refinements (both builds, pinned by tests/ext/test_radix.py):
  - Block hashes are ints in [0, 2**64): insert and mark_resident raise ValueError on anything else, before
    changing the tree; in match, node_of and mark_evicted such a value simply matches nothing.
  - A hash already in the tree elsewhere (a 64-bit collision, a broken chain, a repeat in one sequence) ends a
    new leaf right before it, so the index stays one position per hash.
  - insert, assign: `last_access = max(last_access, now)`. mark_resident sets last_access only on nodes it
    creates (KV events are not requests). A split's new upper half copies the lower half's last_access.
  - assign(path) changes exactly the given nodes, skipping detached ones; a path taken before a later split
    misses the split's new upper half, so assign the path insert returned in the same step.
  - mark_resident: a block at offset k counts only when k equals the worker's run (it extends it); a block
    after a gap is not recorded (conservative: under-reports until the gap is stored again).
  - match.key_node uses each node's whole num_blocks, also for a partially matched last node; Preble's key
    portion of the inserted path is `RadixTree.key_node(tree.insert(...))`.
  - The Cython build interns workers into 256 slots (`MAX_WORKERS`): at most 256 workers may hold state
    (resident or assigned) in one tree at a time; the 257th raises RuntimeError. A slot frees when nothing refers
    to it.

Node (plain attributes in Python; read-only properties in Cython, which return fresh copies of blocks,
children, resident and assigned; only `stats` is writable; never mutate the others in the reference either):
    node.blocks: tuple/list of uint64      # this node's run of block hashes (>= 1)
    node.num_blocks: int
    node.context_blocks: int               # blocks from the root to this node's start
    node.parent: Node | None               # None for a top-level node (the root is internal, never returned)
                                           # and for a node gc detached
    node.is_attached: bool                 # False once gc removed the node
    node.seq: int                          # creation order in its tree (1, 2, ...; a split's new upper half
                                           # gets the next one): unique per tree, the same in both builds, a
                                           # deterministic tie-break where ids would follow memory addresses
    node.children: dict[int, Node]         # first block hash -> child
    node.resident: dict[str, int]          # worker -> leading resident blocks of this node
    node.resident_on(worker) -> int        # resident.get(worker, 0), without the Cython build's dict copy
    node.assigned: set[str]                # workers the router assigned requests through this node
    node.evictions: set[str]               # workers of `assigned` noted (`note_evictions`) evicting blocks of
                                           # this node since; kept with `assigned` (a split copies it, gc and
                                           # unassign_worker clear it), so E2's evicted set for w can hold this
                                           # node's blocks only if w is here (a BlockStored skips the others)
    node.has_evictions(worker) -> bool     # worker in evictions, without the Cython build's set copy
    node.last_access: float
    node.stats: object                     # a slot the policy owns (e.g. windowed request counts); a split
                                           # keeps the ORIGINAL node object as the LOWER half (its children
                                           # and stats stay with it) and inserts a NEW parent node for the
                                           # leading blocks, which copies `assigned` and the resident runs
                                           # (clipped) and starts with stats = None.
Split rule detail: splitting node N (blocks b0..bn-1) at k makes new P = b0..bk-1 (parent of N) and N = bk..bn-1;
P.resident[w] = min(d, k) for d in N.resident; N.resident[w] = d - k for d > k (else removed).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_U64_MAX = (1 << 64) - 1


class Node:
    """One run of consecutive blocks. Read the fields; only `stats` is the caller's to write."""

    __slots__ = (
        "blocks",
        "context_blocks",
        "parent",
        "children",
        "resident",
        "assigned",
        "evictions",
        "last_access",
        "stats",
        "is_attached",
        "seq",
        "_gc_queued",
    )

    def __init__(
        self, blocks: tuple[int, ...], context_blocks: int, parent: Node | None, now: float, seq: int = 0
    ) -> None:
        self.seq: int = seq  # the tree's creation counter: a deterministic tie-break (ids are allocation order)
        self.blocks: tuple[int, ...] = blocks  # this node's run of block hashes (>= 1)
        self.context_blocks: int = context_blocks  # blocks from the root to this node's start
        self.parent: Node | None = parent  # None for a top-level node (the root is never returned)
        self.children: dict[int, Node] = {}  # first block hash -> child
        self.resident: dict[Any, int] = {}  # worker -> leading resident blocks of this node (0 < d <= n)
        self.assigned: set[Any] = set()  # workers the router assigned requests through this node
        self.evictions: set[Any] = set()  # workers of `assigned` that evicted blocks of it since (`note_evictions`)
        self.last_access: float = now
        self.stats: Any = None  # the policy's slot
        self.is_attached: bool = True  # False once gc removed the node from the tree
        self._gc_queued = False  # the tree's: in its gc candidates

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def first_block(self) -> int:
        """`blocks[0]`, the node's key among its parent's children (the C build builds no tuple for it)."""
        return self.blocks[0]

    def resident_on(self, worker: Any) -> int:
        """Leading blocks of this node resident on `worker` (0 when none)."""
        return self.resident.get(worker, 0)

    def has_evictions(self, worker: Any) -> bool:
        return worker in self.evictions

    def __repr__(self) -> str:
        return f"Node(blocks={len(self.blocks)}, context_blocks={self.context_blocks})"


# A set of block hashes (E2's evicted blocks, the fleet's `PrefixIndex`): the reference is `set` itself; the C build's
# `BlockSet` keeps uint64s in a C table and offers the subset of `set` those callers use.
BlockSet = set


@dataclass
class MatchResult:
    """What `RadixTree.match` found for one sequence of block hashes (see the module docstring)."""

    path: list[Node] = field(default_factory=list)  # nodes matched, first to last (the last may be partial)
    matched_blocks: int = 0  # leading blocks present in the tree
    resident_blocks: dict[Any, int] = field(default_factory=dict)  # worker -> leading blocks resident on it
    assigned_blocks: dict[Any, int] = field(default_factory=dict)  # worker -> leading blocks assigned to it
    key_node: Node | None = None  # deepest path node with num_blocks > context_blocks


def key_node(path: Sequence[Node]) -> Node | None:
    """Preble's key portion of a path: the deepest node with more blocks than all its predecessors together."""
    found = None
    for node in path:
        if node.num_blocks > node.context_blocks:
            found = node
    return found


def _check_key(h: Any) -> int:
    if not isinstance(h, int) or not 0 <= h <= _U64_MAX:
        raise ValueError(f"block hash {h!r} is not a uint64")
    return int(h)


MAX_WORKERS: int | None = None  # workers that may hold state in a tree at once (None: no limit; the C build: 256)


class RadixTree:
    """The global prefix tree over chained block hashes; see the module docstring for the contract."""

    def __init__(self, chained: bool = False) -> None:
        self.chained = chained  # a promise about the input this build does not need (see the contract)
        self._root = Node((), 0, None, 0.0)
        self._next_seq = 1
        self._index: dict[int, tuple[Node, int]] = {}  # block hash -> (node, offset in node.blocks)
        self._num_nodes = 0
        # gc's candidates: every attached node with no children and no resident worker is here (queued when it
        # becomes one; node._gc_queued), lazily, in buckets by the whole second of its last_access then (never
        # above its current one)
        self._dead: dict[int, list[Node]] = {}
        self.gc_visits = 0  # candidates gc has taken off its queue, in all: its work, whatever it removed

    # ---- read-only -------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def node_of(self, block_hash: int) -> tuple[Node, int] | None:
        return self._index.get(block_hash)

    def runs_of(self, block_hashes: Sequence[int]) -> list[tuple[Node, int, int]]:
        """(node, i, j): each maximal run of consecutive positions i..j-1 of `block_hashes` whose blocks lie in one
        node, in order; blocks not in the tree are skipped. A KV event's blocks are a few long runs: its nodes
        without an offset scan or a lookup per block on the caller's side."""
        out: list[tuple[Node, int, int]] = []
        index = self._index
        for i, h in enumerate(block_hashes):
            pos = index.get(h) if isinstance(h, int) else None
            if pos is None:
                continue
            node = pos[0]
            if out and out[-1][0] is node and out[-1][2] == i:
                out[-1] = (node, out[-1][1], i + 1)
            else:
                out.append((node, i, i + 1))
        return out

    def nodes(self) -> list[Node]:
        """Every node, pre-order (a parent before its children; children in insertion order)."""
        out: list[Node] = []
        stack = list(reversed(self._root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    key_node = staticmethod(key_node)

    def _new_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _walk(self, block_hashes: Sequence[int]) -> tuple[list[Node], int, int]:
        """(path, matched blocks, matched blocks of the last path node)."""
        path: list[Node] = []
        node = self._root
        i = 0
        m = 0
        n = len(block_hashes)
        while i < n:
            child = node.children.get(block_hashes[i])
            if child is None:
                break
            m = 1
            while m < child.num_blocks and i + m < n and child.blocks[m] == block_hashes[i + m]:
                m += 1
            path.append(child)
            i += m
            if m < child.num_blocks:
                break
            node = child
        return path, i, m

    def match_cached(
        self, block_hashes: Sequence[int], workers: Iterable[Any], evicted: Mapping[Any, Container[int]]
    ) -> tuple[dict[Any, int], int, list[Node]]:
        m = self.match(block_hashes)
        cached: dict[Any, int] = {}
        for w in workers:
            r, a = m.resident_blocks.get(w, 0), m.assigned_blocks.get(w, 0)
            ev = evicted.get(w)
            if a > r and ev:
                a = next((k for k in range(r, a) if block_hashes[k] in ev), a)
            cached[w] = max(r, a)
        return cached, max(cached.values(), default=0), m.path

    @staticmethod
    def key_portion(path: Sequence[Node], upto: int, study: bool) -> tuple[Node | None, int]:
        best, end, best_n = None, 0, 0
        for node in path:
            start = node.context_blocks
            if start >= upto:
                break
            n = min(node.num_blocks, upto - start)
            if (n > start) if study else (n > best_n):
                best, end, best_n = node, start + n, n
        return best, end

    def walk(self, block_hashes: Sequence[int]) -> tuple[list[Node], int]:
        """(`match`'s path, its matched blocks) without the per-worker runs: a key-portion lookup."""
        path, matched, _ = self._walk(block_hashes)
        return path, matched

    def match(self, block_hashes: Sequence[int]) -> MatchResult:
        path, matched, last_m = self._walk(block_hashes)
        result = MatchResult(path=path, matched_blocks=matched, key_node=key_node(path))
        # Leading runs, the obvious way: walk the path per worker and stop at the first gap.
        workers_res = {w for node in path[:1] for w in node.resident}
        workers_asg = {w for node in path[:1] for w in node.assigned}
        for w in workers_res:
            total = 0
            for j, node in enumerate(path):
                m = last_m if j == len(path) - 1 else node.num_blocks
                take = min(node.resident.get(w, 0), m)
                total += take
                if take < m:
                    break
            result.resident_blocks[w] = total
        for w in workers_asg:
            total = 0
            for j, node in enumerate(path):
                if w not in node.assigned:
                    break
                total += last_m if j == len(path) - 1 else node.num_blocks
            result.assigned_blocks[w] = total
        return result

    # ---- structure -------------------------------------------------------------------------------------

    def _split(self, node: Node, k: int) -> Node:
        """Split `node` after its first k blocks (0 < k < n); returns the new upper half (see the docstring)."""
        assert 0 < k < node.num_blocks
        parent = node.parent if node.parent is not None else self._root
        upper = Node(node.blocks[:k], node.context_blocks, node.parent, node.last_access, self._new_seq())
        upper.assigned = set(node.assigned)
        upper.evictions = set(node.evictions)
        for w, d in node.resident.items():
            upper.resident[w] = min(d, k)
        node.resident = {w: d - k for w, d in node.resident.items() if d > k}
        if not node.resident:
            self._candidate(node)
        node.blocks = node.blocks[k:]
        node.context_blocks += k
        node.parent = upper
        upper.children[node.blocks[0]] = node
        parent.children[upper.blocks[0]] = upper
        for off, h in enumerate(upper.blocks):
            self._index[h] = (upper, off)
        for off, h in enumerate(node.blocks):
            self._index[h] = (node, off)
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: Node, blocks: Sequence[int], now: float) -> Node | None:
        """Hang `blocks` under `parent`, cut at the first hash already in the tree (a collision or bad chain)."""
        run: list[int] = []
        seen: set[int] = set()
        for h in blocks:
            if h in self._index or h in seen:
                break
            run.append(h)
            seen.add(h)
        if not run:
            return None
        context = parent.context_blocks + parent.num_blocks
        leaf = Node(tuple(run), context, parent if parent is not self._root else None, now, self._new_seq())
        parent.children[run[0]] = leaf
        for off, h in enumerate(run):
            self._index[h] = (leaf, off)
        self._num_nodes += 1
        return leaf

    def _position_end(self, node: Node, offset: int) -> Node:
        """The node that ends right after block `offset` of `node` (splitting it when that is mid-node)."""
        if offset + 1 < node.num_blocks:
            return self._split(node, offset + 1)
        return node

    def insert(self, block_hashes: Sequence[int], now: float) -> list[Node]:
        for h in block_hashes:
            _check_key(h)
        path, matched, last_m = self._walk(block_hashes)
        if path and last_m < path[-1].num_blocks:
            path[-1] = self._split(path[-1], last_m)
        if matched < len(block_hashes):
            leaf = self._add_leaf(path[-1] if path else self._root, block_hashes[matched:], now)
            if leaf is not None:
                path.append(leaf)
                self._candidate(leaf)  # resident nowhere yet
        for node in path:
            node.last_access = max(node.last_access, now)
        return path

    # ---- assignment (optimistic) -----------------------------------------------------------------------

    def assign(self, path: Iterable[Node], worker: Any, now: float) -> None:
        for node in path:
            if node.is_attached:
                node.assigned.add(worker)
                node.last_access = max(node.last_access, now)

    def unassign_worker(self, worker: Any) -> None:
        for node in self.nodes():
            node.assigned.discard(worker)
            node.evictions.discard(worker)

    def note_evictions(self, node: Node, worker: Any) -> bool:
        if worker not in node.assigned:
            return False
        node.evictions.add(worker)
        return True

    # ---- KV events ---------------------------------------------------------------------------------------

    def mark_resident(
        self, worker: Any, block_hashes: Sequence[int], parent_hash: int | None, now: float
    ) -> None:
        for h in block_hashes:
            _check_key(h)
        prev: tuple[Node, int] | None = None  # position of the previous block; None = the root
        if parent_hash is not None:
            prev = self._index.get(parent_hash)
            if prev is None:
                return  # unknown parent: ignored (a snapshot replays parents first)
        for i, h in enumerate(block_hashes):
            pos = self._index.get(h)
            if pos is None:  # unknown from here on: one new leaf right after prev (splitting prev's node)
                under = self._root if prev is None else self._position_end(*prev)
                leaf = self._add_leaf(under, block_hashes[i:], now)
                assert leaf is not None  # h itself is unknown, so the run holds at least h
                pos = (leaf, 0)
            node, off = pos
            if node.resident.get(worker, 0) == off:  # the block right after the leading run extends it
                node.resident[worker] = off + 1
            prev = pos

    def mark_evicted(self, worker: Any, block_hashes: Iterable[int]) -> None:
        for h in block_hashes:
            pos = self._index.get(h)
            if pos is None:
                continue
            node, off = pos
            d = node.resident.get(worker, 0)
            if min(d, off) > 0:
                node.resident[worker] = min(d, off)
            elif node.resident.pop(worker, None) is not None and not node.resident:
                self._candidate(node)

    def clear_worker(self, worker: Any) -> None:
        for node in self.nodes():
            if node.resident.pop(worker, None) is not None and not node.resident:
                self._candidate(node)

    def remove_worker(self, worker: Any) -> None:
        self.clear_worker(worker)
        self.unassign_worker(worker)

    # ---- garbage collection -------------------------------------------------------------------------------

    def _candidate(self, node: Node) -> None:
        """`node` may have become one with no children and no resident worker: queue it for gc."""
        if not node._gc_queued:
            node._gc_queued = True
            self._dead.setdefault(math.floor(node.last_access), []).append(node)

    @staticmethod
    def block_set() -> set[int]:
        """An empty set of block hashes for `gc(evicted=...)` and `match_cached` (this build's `BlockSet`: `set`)."""
        return BlockSet()

    def gc(
        self, now: float, window_s: float, budget_blocks: int | None = None,
        removed_out: list[tuple[tuple[int, ...], set[Any]]] | None = None,
        evicted: dict[Any, set[int]] | None = None,
    ) -> int:
        """Removes what a post-order pass over every node would (a node's children are decided before it, so a
        chain of dead leaves goes at once), visiting only the queued candidates of the buckets old enough.

        NOTE: exact, and O(candidates visited), not O(nodes): every attached node without children or residents
        is queued under a bucket b at most its last_access, and rounded subtraction is monotone, so a node of b
        passes the test (now - last_access > window_s) only if now - b > window_s: the pass stops at the first
        bucket where that fails (an earlier bound, floor(now - window_s) + 1, had it visit the next second's
        nodes on every call, ~40k at a time after a burst, only to queue them again). A visited node that gained
        children or a resident worker is dropped (it is queued again when it loses them); one not old enough is
        queued again, after the pass, under its current last_access. A parent left childless is queued at once,
        and the pass takes the lowest bucket each time, so it reaches the parent too.

        `budget_blocks`: stop once the removed nodes' blocks plus the candidates visited reach it (a bound on one
        call's time: a visit that removes nothing, a resident or young candidate, is work too; a mass expiry is
        then spread over several calls); the candidates not visited stay queued, in order. `gc_visits` counts
        the visits of every call. Which dead nodes a budgeted call takes first follows the candidate queue, which
        the two builds fill in different orders: the removed nodes are dead by the definition in both, and calls
        until one stops short of its budget remove the same set. `removed_out` gets (blocks, assigned workers) of each removed node that had
        assigned workers, for side tables keyed by block and worker. `evicted` (worker -> set of block hashes,
        E2's blocks evicted since assignment) has each removed node's blocks dropped from the sets of the
        workers it was assigned to: a hash can be in a worker's set only while its node is assigned there.
        """
        removed = freed = visited = 0
        dead = self._dead
        young: list[Node] = []
        while dead:
            b = min(dead)
            if not now - b > window_s:
                break
            bucket = dead.pop(b)
            for at, node in enumerate(bucket):
                if budget_blocks is not None and freed + visited >= budget_blocks:
                    del bucket[:at]  # the rest, still flagged queued, in order (in place, as the Cython build)
                    bucket.extend(dead.get(b, ()))
                    dead[b] = bucket
                    break
                visited += 1
                node._gc_queued = False
                if not node.is_attached or node.children or node.resident:
                    continue
                if not now - node.last_access > window_s:
                    young.append(node)
                    continue
                parent = node.parent if node.parent is not None else self._root
                del parent.children[node.blocks[0]]
                for h in node.blocks:
                    del self._index[h]
                if removed_out is not None and node.assigned:
                    removed_out.append((node.blocks, node.assigned))
                if evicted:
                    for w in node.assigned:
                        ev = evicted.get(w)
                        if ev:
                            ev.difference_update(node.blocks)
                node.is_attached = False
                node.parent = None
                node.assigned = set()  # a detached node keeps no worker state
                node.evictions = set()
                self._num_nodes -= 1
                removed += 1
                freed += node.num_blocks
                if parent is not self._root and not parent.children and not parent.resident:
                    self._candidate(parent)
            if budget_blocks is not None and freed + visited >= budget_blocks:
                break
        for node in young:
            self._candidate(node)
        self.gc_visits += visited
        return removed

    # ---- tests -------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        seen_blocks = 0
        count = 0
        for node in self.nodes():
            count += 1
            parent = node.parent if node.parent is not None else self._root
            assert node.is_attached
            assert node.num_blocks >= 1
            assert parent.children.get(node.blocks[0]) is node
            assert node.context_blocks == parent.context_blocks + parent.num_blocks
            for key, child in node.children.items():
                assert child.blocks[0] == key and (child.parent is node)
            for off, h in enumerate(node.blocks):
                assert self._index.get(h) == (node, off), (h, off)
            for w, d in node.resident.items():
                assert 0 < d <= node.num_blocks, (w, d)
            assert node.evictions <= node.assigned
            seen_blocks += node.num_blocks
        for child in self._root.children.values():
            assert child.parent is None
        assert count == self._num_nodes
        assert seen_blocks == len(self._index)
