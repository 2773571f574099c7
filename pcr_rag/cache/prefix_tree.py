"""The prefix tree of chunks: nodes, match, insert, explicit leaf set. Knows nothing about bytes or tiers.

Structure: a forest of virtual *root* nodes (one per namespace root key, created on demand, never cached, dropped
when childless) whose descendants are chunk nodes. Invariants (``check()``):
- every chunk node's parent is a root or a chunk node in the tree; ``parent.children`` lists it;
- ``index`` maps each chunk key to its node (roots are not in ``index``);
- ``leaves`` is exactly the set of chunk nodes without children.
Because keys are chained hashes, ``match`` needs no per-node child lookup: keys[i] must be in ``index`` and its
node's parent must be the node of keys[i-1] (or a root for i == 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

__all__ = ["Node", "PrefixTree"]


class Node:
    """A tree node. ``children`` is None for a leaf (saves memory at millions of nodes)."""

    __slots__ = ("key", "parent", "children", "num_tokens", "is_root")

    def __init__(self, key: bytes, parent: Node | None, num_tokens: int = 0, is_root: bool = False) -> None:
        self.key = key
        self.parent = parent
        self.children: list[Node] | None = None
        self.num_tokens = num_tokens
        self.is_root = is_root

    @property
    def num_children(self) -> int:
        return 0 if self.children is None else len(self.children)

    def __repr__(self) -> str:
        kind = "root" if self.is_root else "node"
        return f"<{kind} {self.key.hex()[:12]} tokens={self.num_tokens} children={self.num_children}>"


class PrefixTree:
    """Chunk nodes under namespace roots. ``node_factory(key, parent, num_tokens)`` builds chunk nodes, so the
    cache engine can use a subclass carrying its tier fields."""

    def __init__(self, node_factory: Callable[[bytes, Node, int], Node] | None = None) -> None:
        self._factory = node_factory or (lambda key, parent, n: Node(key, parent, n))
        self.index: dict[bytes, Node] = {}
        self.roots: dict[bytes, Node] = {}
        self.leaves: set[Node] = set()

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def get(self, key: bytes) -> Node | None:
        return self.index.get(key)

    def match(self, keys: Sequence[bytes], max_chunks: int | None = None) -> list[Node]:
        """Walk the chain ``keys`` from a root until the first mismatch; return the matched nodes in order."""
        out: list[Node] = []
        limit = len(keys) if max_chunks is None else min(len(keys), max(0, max_chunks))
        index = self.index
        prev: Node | None = None
        for i in range(limit):
            node = index.get(keys[i])
            if node is None:
                break
            parent = node.parent
            if (prev is None and not parent.is_root) or (prev is not None and parent is not prev):
                break
            out.append(node)
            prev = node
        return out

    def parent_for(self, parent_key: bytes, parent_is_root: bool) -> Node | None:
        """The node a new child of ``parent_key`` would hang from, or None when that parent is not in the tree.
        Roots are created on demand by ``add`` and are not returned here unless present."""
        if parent_is_root:
            return self.roots.get(parent_key)
        return self.index.get(parent_key)

    def add(self, key: bytes, parent_key: bytes, parent_is_root: bool, num_tokens: int) -> Node:
        """Add a chunk node under its parent (created when it is a root). Raises KeyError when the key already
        exists or the non-root parent is missing."""
        if key in self.index:
            raise KeyError(f"chunk {key.hex()} already in the tree")
        if parent_is_root:
            parent = self.roots.get(parent_key)
            if parent is None:
                parent = Node(parent_key, None, 0, is_root=True)
                self.roots[parent_key] = parent
        else:
            parent = self.index.get(parent_key)
            if parent is None:
                raise KeyError(f"parent {parent_key.hex()} of chunk {key.hex()} is not in the tree")
        node = self._factory(key, parent, num_tokens)
        if parent.children is None:
            parent.children = [node]
            self.leaves.discard(parent)
        else:
            parent.children.append(node)
        self.index[key] = node
        self.leaves.add(node)
        return node

    def remove(self, node: Node) -> None:
        """Remove a childless chunk node; its parent becomes a leaf when this was its last child."""
        if node.children:
            raise ValueError(f"cannot remove {node!r}: it still has children")
        if self.index.get(node.key) is not node:
            raise KeyError(f"{node!r} is not in the tree")
        del self.index[node.key]
        self.leaves.discard(node)
        parent = node.parent
        siblings = parent.children
        siblings.remove(node)
        if not siblings:
            parent.children = None
            if parent.is_root:
                del self.roots[parent.key]
            else:
                self.leaves.add(parent)

    def subtree_postorder(self, node: Node) -> list[Node]:
        """``node`` and all its descendants, children before parents (a safe removal order)."""
        out: list[Node] = []
        stack: list[tuple[Node, bool]] = [(node, False)]
        while stack:
            cur, expanded = stack.pop()
            if expanded or not cur.children:
                out.append(cur)
            else:
                stack.append((cur, True))
                stack.extend((child, False) for child in cur.children)
        return out

    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.index.values())

    def depth(self, node: Node) -> int:
        d = 0
        while not node.is_root:
            node = node.parent
            d += 1
        return d

    def check(self) -> None:
        """Assert the structural invariants (tests and debugging; O(nodes))."""
        for key, node in self.index.items():
            assert node.key == key, "index key mismatch"
            assert not node.is_root, "root in index"
            parent = node.parent
            assert parent is not None
            if parent.is_root:
                assert self.roots.get(parent.key) is parent, "dangling root"
            else:
                assert self.index.get(parent.key) is parent, f"parent of {node!r} not in tree"
            assert parent.children is not None and node in parent.children, "child not listed by parent"
            assert (node in self.leaves) == (not node.children), f"leaf set wrong for {node!r}"
            if node.children is not None:
                assert node.children, "empty children list must be None"
        for root in self.roots.values():
            assert root.is_root and root.children, "roots must have children"
        assert len(self.leaves) == sum(1 for n in self.index.values() if not n.children)
