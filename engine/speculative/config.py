"""Speculative decoding settings (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("eagle2", "eagle3", "eagle1", "ngram", "none")
# (total_tokens, depth, top_k) when not given. ngram verifies 4 tokens: larger trees leave the
# native few-row kernels and cost more to verify than they gain (picked by bench/bench_spec.py).
METHOD_DEFAULTS = {"eagle2": (24, 5, 4), "eagle3": (24, 5, 4), "eagle1": (24, 5, 4), "ngram": (4, 3, 1),
                   "none": (1, 1, 1)}

# EAGLE-1 style static tree: paths of child ranks below the root ([0, 1] = the best child's
# second-best child). 24 nodes, depth 4: wide near the root where the draft is least sure.
DEFAULT_STATIC_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 2, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0, 0),
)


@dataclass(frozen=True)
class SpecConfig:
    """method: eagle2 (dynamic tree), eagle3 (dynamic tree, EAGLE-3 head), eagle1 (static
    tree), ngram (prompt lookup), none.

    total_tokens: tokens the target verifies per round, root included (eagle2, eagle3, ngram);
    depth: draft steps per round (eagle2, eagle3; ngram: longest proposal); top_k: children
    expanded per node and frontier width (eagle2, eagle3); static_tree: rank paths (eagle1).
    """

    method: str = "none"
    total_tokens: int | None = None  # None: the method's default (METHOD_DEFAULTS)
    depth: int | None = None
    top_k: int | None = None
    static_tree: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_TREE
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"spec method must be one of {METHODS}, got {self.method!r}")
        for name, value in zip(("total_tokens", "depth", "top_k"), METHOD_DEFAULTS[self.method]):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.total_tokens < 1 or self.depth < 1 or self.top_k < 1:
            raise ValueError("total_tokens, depth and top_k must be >= 1")
        if not isinstance(self.static_tree, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in p)
                for p in self.static_tree):
            raise ValueError("static_tree must be a list of rank paths, each a list of integers (e.g. [[0], [1], [0, 0]])")
        if not self.static_tree or any(not p or min(p) < 0 for p in self.static_tree):
            raise ValueError("static_tree must be a non-empty list of non-empty rank paths")
        prefixes = {tuple(p) for p in self.static_tree}
        for p in self.static_tree:
            if len(p) > 1 and tuple(p[:-1]) not in prefixes:
                raise ValueError(f"static_tree path {list(p)} has no parent path {list(p[:-1])}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        object.__setattr__(self, "static_tree", tuple(tuple(p) for p in self.static_tree))

    @property
    def uses_head(self) -> bool:
        return self.method in ("eagle2", "eagle3", "eagle1")

    @property
    def dynamic_tree(self) -> bool:
        """Whether rounds grow EAGLE-2's dynamic tree (cut to depth and size per round)."""
        return self.method in ("eagle2", "eagle3")

    @property
    def max_depth(self) -> int:
        """Most draft tokens on one path."""
        if self.method == "none":
            return 0
        if self.method == "eagle1":
            return max(len(p) for p in self.static_tree)
        return min(self.depth, self.total_tokens - 1)

    @property
    def tree_tokens(self) -> int:
        """Most tokens a round verifies, root included."""
        if self.method == "none":
            return 1
        if self.method == "eagle1":
            return 1 + len({tuple(p) for p in self.static_tree})
        return self.total_tokens

    @property
    def scratch_slots(self) -> int:
        """Slots past the committed length a round writes: the target's tree, and the draft's
        expanded frontier (top_k nodes per depth after the first)."""
        draft = self.top_k * max(0, self.max_depth - 1) if self.uses_head else 0
        if self.method == "eagle1":
            draft = len(self.static_tree)
        return max(self.tree_tokens, draft + 1)
