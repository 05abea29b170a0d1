"""Tree acceptance: follow the target's own choices down the draft tree.

At every node the target picks a token y from its processed distribution (argmax for greedy,
Gumbel-max with noise keyed by (seed, output position) for sampling). If y is one of the
node's children the child is accepted and the walk continues; otherwise y is the bonus token.
For children chosen deterministically (top-k) this equals EAGLE's rule (try the children in
turn, accept child x with the residual probability p(x), zero it on rejection, renormalise,
bonus from what remains), and with the same noise it picks exactly what plain decoding picks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle_serve.engine.speculative.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: list[int]  # node indices below the root, in path order
    tokens: list[int]  # emitted: the accepted nodes' tokens, then the bonus token


def walk(tree: DraftTree, chosen: Sequence[int]) -> VerifyResult:
    """chosen[i]: the token the target picks at node i, read only for the nodes the walk reaches
    (the runner passes picks that are drawn when read)."""
    children = tree.children()
    node, accepted = 0, []
    while (nxt := children[node].get(chosen[node])) is not None:
        accepted.append(nxt)
        node = nxt
    return VerifyResult(accepted, [tree.tokens[n] for n in accepted] + [chosen[node]])
