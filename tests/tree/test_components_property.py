"""Property test: a hybrid tree (full + sliding window + Mamba) driven by a small owner.

The owner does what the cache facade will: match, load back every component a hit needs,
compute and insert the rest (the request keeps only its window of SWA pages and a state
snapshot at its end), write-through backups per component, and eviction of each component
under its own pool's budget. Every id carries a label (the token prefix whose data it
holds), moved by each copy; after every step the tree and allocators pass their checks,
allocators own exactly the tree's ids, and every id holds what its node says.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.memory import PageAllocator
from hicache.tree import ComponentValues, HiRadixTree, MambaState, SlidingWindow, Tier, TreeNode
from hicache.tree.node import PageIds, decode_tokens, page_ids

PAGE = 2
WINDOW = 3
D, H = Tier.DEVICE, Tier.HOST
SIZES = {("full", D): 10, ("full", H): 20, ("swa", D): 6, ("swa", H): 12}
SIZES |= {("mamba", D): 3, ("mamba", H): 6}
sequences = st.lists(st.integers(0, 2), min_size=PAGE, max_size=6 * PAGE)
Label = tuple[int, ...]


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = HiRadixTree(PAGE, components=[SlidingWindow(WINDOW), MambaState()])
        self.alloc = {k: PageAllocator(n) for k, n in SIZES.items()}
        self.label: dict[tuple[str, Tier], dict[int, Label]] = {k: {} for k in SIZES}

    # -- owner helpers -----------------------------------------------------------------
    def node_label(self, node: TreeNode, name: str, i: int) -> Label:
        """What id ``i`` of ``node``'s ``name`` value must hold."""
        path = decode_tokens(self.tree.path_key(node))
        start = len(path) - len(node.key) // 4
        if name == "mamba":
            return tuple(path)
        return tuple(path[: start + (i + 1) * PAGE])

    def take(self, name: str, tier: Tier, n: int) -> list[int] | None:
        """Allocate, evicting ``name`` in ``tier`` under its own budget when short."""
        a = self.alloc[(name, tier)]
        if a.free_pages < n:
            self.make_room(name, tier, n - a.free_pages)
        return a.alloc(n)

    def free(self, name: str, tier: Tier, ids: PageIds | list[int]) -> None:
        for i in ids:
            del self.label[(name, tier)][i]
        self.alloc[(name, tier)].free(ids)

    def make_room(self, name: str, tier: Tier, need: int) -> None:
        t = self.tree
        order: Iterator[TreeNode]
        if name != "full":
            order = t.component_eviction_order(name, tier)
        else:
            order = t.device_eviction_order() if tier is D else t.host_eviction_order()
        freed = 0
        for node in order:
            if freed >= need:
                break
            if name != "full":
                ids = t.evict_component(name, node, tier)
                self.free(name, tier, ids)
                freed += len(ids)
                continue
            ev = t.evict_node_device(node) if tier is D else t.evict_node_host(node)
            self.free("full", tier, ev.full)
            for cname, ids in ev.components.items():
                self.free(cname, tier, ids)
            freed += len(ev.full)

    def copy(self, name: str, src: Tier, src_ids: PageIds, dst: Tier, dst_ids: list[int]) -> None:
        for s, d in zip(src_ids, dst_ids, strict=True):
            self.label[(name, dst)][d] = self.label[(name, src)][s]

    # -- rules -------------------------------------------------------------------------
    @rule(tokens=sequences, backup=st.booleans())
    def request(self, tokens: list[int], backup: bool) -> None:
        t = self.tree
        n_pages = len(tokens) // PAGE
        m = t.match_prefix(tokens)
        hit = m.last_host_node
        t.inc_lock_ref(m.last_device_node)
        t.inc_host_ref(hit)
        if hit is not m.last_device_node and self.load_back(hit):
            t.dec_lock_ref(m.last_device_node)
            t.inc_lock_ref(hit)
            base = hit
        else:
            base = m.last_device_node
        t.dec_host_ref(hit)
        # the hit's data must be exactly the prefix's
        matched = t.depth_pages(base)
        full = page_ids()
        for n in self.path(base):
            assert n.device is not None
            full.extend(n.device)
        for i, p in enumerate(full):
            assert self.label[("full", D)][p] == tuple(tokens[: (i + 1) * PAGE])
        if base.parent is not None:
            swa = t.hit_ids("swa", base)
            first = matched - len(swa)
            assert first == max(0, matched - math.ceil(WINDOW / PAGE))
            for i, p in enumerate(swa):
                assert self.label[("swa", D)][p] == tuple(tokens[: (first + i + 1) * PAGE])
            (slot,) = t.hit_ids("mamba", base)
            assert self.label[("mamba", D)][slot] == tuple(tokens[: matched * PAGE])
        # compute the rest: full pages, the window's SWA pages, a snapshot at the end
        new = n_pages - matched
        pages = self.take("full", D, new) if new else []
        keep = min(new, math.ceil(WINDOW / PAGE))
        swa_new = self.take("swa", D, keep) if keep else []
        slot_new = self.take("mamba", D, 1) if new else []
        if pages is None or swa_new is None or slot_new is None:
            for name, got in (("full", pages), ("swa", swa_new), ("mamba", slot_new)):
                if got:
                    self.alloc[(name, D)].free(got)
            t.dec_lock_ref(base)
            return
        for i, p in enumerate(pages):
            self.label[("full", D)][p] = tuple(tokens[: (matched + i + 1) * PAGE])
        for i, p in enumerate(swa_new):
            self.label[("swa", D)][p] = tuple(tokens[: (n_pages - keep + i + 1) * PAGE])
        comps: dict[str, ComponentValues] = {}
        if swa_new:
            comps["swa"] = ComponentValues.pages(n_pages - keep, swa_new)
        if slot_new:
            self.label[("mamba", D)][slot_new[0]] = tuple(tokens[: n_pages * PAGE])
            comps["mamba"] = ComponentValues.snapshots({n_pages: slot_new[0]})
        r = t.insert(tokens, full + page_ids(pages), components=comps)
        self.free("full", D, r.duplicate_pages)
        for name, dup in r.component_duplicates.items():
            self.free(name, D, dup)
        t.inc_lock_ref(r.last_node)
        t.dec_lock_ref(base)
        if backup:
            self.back_up(r.last_node)
        t.dec_lock_ref(r.last_node)

    def path(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def load_back(self, hit: TreeNode) -> bool:
        """Copy L2 -> L1 what a hit at ``hit`` needs; False (nothing changed) if no room."""
        t = self.tree
        nodes = t.host_only_path(hit)
        need = sum(t.num_pages(n) for n in nodes)
        pages = self.take("full", D, need)
        if pages is None:
            return False
        at = 0
        for n in nodes:
            k = t.num_pages(n)
            assert n.host is not None
            self.copy("full", H, n.host, D, pages[at : at + k])
            t.assign_device(n, page_ids(pages[at : at + k]))
            at += k
        for name in ("swa", "mamba"):
            for n in t.component_load_nodes(name, hit):
                host = t.component(name).get(n, H)
                assert host is not None
                got = self.take(name, D, len(host))
                if got is None:
                    return True  # full pages are in; the hit falls back to the L1 part
                self.copy(name, H, host, D, got)
                t.assign_component(name, n, D, page_ids(got))
        return all(
            t.component(c).get(n, D) is not None
            for c in ("swa", "mamba")
            for n in t.hit_nodes(c, hit)
        )

    def back_up(self, last: TreeNode) -> None:
        t = self.tree
        nodes = t.nodes_to_back_up(last)
        need = sum(t.num_pages(n) for n in nodes)
        got = self.take("full", H, need)
        if got is None:
            return
        at = 0
        for n in nodes:
            k = t.num_pages(n)
            assert n.device is not None
            self.copy("full", D, n.device, H, got[at : at + k])
            t.assign_host(n, page_ids(got[at : at + k]))
            at += k
        for name in ("swa", "mamba"):
            for n in t.component_backup_nodes(name, last):
                dev = t.component(name).get(n, D)
                assert dev is not None
                ids = self.take(name, H, len(dev))
                if ids is None:
                    break
                self.copy(name, D, dev, H, ids)
                t.assign_component(name, n, H, page_ids(ids))

    @rule(
        key=st.sampled_from(sorted(SIZES, key=lambda k: (k[0], k[1].value))),
        n=st.integers(1, 4),
    )
    def evict(self, key: tuple[str, Tier], n: int) -> None:
        self.make_room(key[0], key[1], n)

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        t = self.tree
        t.check_integrity()
        for (name, tier), a in self.alloc.items():
            a.check_integrity()
            if name == "full":
                owned = t.device_page_ids() if tier is D else t.host_page_ids()
            else:
                owned = t.component_ids(name, tier)
            assert sorted(owned) == sorted(self.label[(name, tier)]), (name, tier)
            assert a.used_pages == len(owned), (name, tier)
        for node in t.iter_nodes():
            assert node.lock_ref == 0 and node.host_ref == 0
            for c in t.components:
                for tier in (D, H):
                    ids = c.get(node, tier)
                    for i, p in enumerate(ids or ()):
                        assert self.label[(c.name, tier)][p] == self.node_label(node, c.name, i)


TestHybridTree = HybridMachine.TestCase
TestHybridTree.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
