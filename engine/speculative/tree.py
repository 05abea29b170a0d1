"""`DraftTree`: the tokens a round asks the target to verify, built by small pure functions.

Node 0 is the root: the sequence's last sampled token, whose KV the verify forward computes.
Nodes are in topological order (a parent's index is below its children's), so
`parents[i] < i` for i > 0 and the ancestor mask is lower-triangular.

Drafting produces *candidates*: every token proposed at every depth, each with its parent
candidate (-1 for a child of the root) and its cumulative draft log-probability (the sum along
its path, an estimate of log P(target accepts the whole path)). EAGLE-2 keeps the best
`total_tokens - 1` candidates; because a child's score never exceeds its parent's, the kept set
is closed under parents.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidates:
    tokens: list[int]
    parents: list[int]  # index into these candidates, -1 = the root
    scores: list[float]  # cumulative draft log-probability

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # [N], tokens[0] is the root
    parents: list[int]  # [N], parents[0] == -1
    depths: list[int]  # [N], depths[0] == 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[dict[int, int]]:
        """children()[i] maps a child's token to its node index."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            out[self.parents[i]][self.tokens[i]] = i
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        rows = [[False] * n for _ in range(n)]
        for i in range(n):  # parents come first, so their rows are complete
            if i:
                rows[i][:i] = rows[self.parents[i]][:i]
            rows[i][i] = True
        # (lists, one tensor at the end: a torch op per row cost 20 us at 7 nodes, this 7)
        return torch.tensor(rows, dtype=torch.bool)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def leaf_paths(self) -> list[list[int]]:
        has_child = set(self.parents[1:])
        return [self.path(i) for i in range(len(self.tokens)) if i not in has_child]


def root_only(token: int) -> DraftTree:
    """A round that speculates nothing: plain decoding through the same loop."""
    return DraftTree([token], [-1], [0])


def select_best(cands: Candidates, n_keep: int) -> list[int]:
    """Indices of the best `n_keep` candidates by score, in candidate order. Ties go to the
    earlier candidate, so a parent (always earlier) is never dropped for an equal child."""
    order = sorted(range(len(cands)), key=lambda i: (-cands.scores[i], i))
    return sorted(order[:n_keep])


def build_tree(root: int, cands: Candidates, keep: list[int]) -> DraftTree:
    """The tree of the root and the kept candidates (`keep` sorted, closed under parents)."""
    node_of = {c: i + 1 for i, c in enumerate(keep)}  # candidate index -> node index
    tokens, parents, depths = [root], [-1], [0]
    for c in keep:
        p = cands.parents[c]
        if p >= 0 and p not in node_of:
            raise ValueError(f"candidate {c} kept without its parent {p}")
        parent_node = node_of[p] if p >= 0 else 0
        tokens.append(cands.tokens[c])
        parents.append(parent_node)
        depths.append(depths[parent_node] + 1)
    return DraftTree(tokens, parents, depths)


def chain(root: int, tokens: list[int]) -> DraftTree:
    """A single path (n-gram lookup, oracle drafts)."""
    n = len(tokens)
    return DraftTree([root] + list(tokens), [-1] + list(range(n)), list(range(n + 1)))


def from_paths(root: int, paths: list[list[int]]) -> DraftTree:
    """A static tree from token paths below the root (shared prefixes merged)."""
    tokens, parents, depths = [root], [-1], [0]
    index: dict[tuple[int, ...], int] = {(): 0}
    for path in paths:
        for d in range(1, len(path) + 1):
            key = tuple(path[:d])
            if key not in index:
                index[key] = len(tokens)
                tokens.append(path[d - 1])
                parents.append(index[key[:-1]])
                depths.append(d)
    return DraftTree(tokens, parents, depths)


def prune(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The tree without the nodes below the root that `keep` (one flag a node, node 1 first)
    drops, and their descendants."""
    alive = [True] + list(keep)
    node_of, tokens, parents, depths = {0: 0}, [tree.tokens[0]], [-1], [0]
    for i in range(1, len(tree)):
        p = tree.parents[i]
        if alive[i] and p in node_of:
            node_of[i] = len(tokens)
            tokens.append(tree.tokens[i])
            parents.append(node_of[p])
            depths.append(tree.depths[i])
    return DraftTree(tokens, parents, depths)
