"""Static draft trees and their exact acceptance (docs/architecture.md, "Draft trees").

A tree's shape is its branching per depth, b_1..b_D: the root (the pending token, verify row 0) has b_1
children, each of those b_2, and so on; a chain of gamma drafts is the tree (1, ..., 1). Nodes are
flattened in BFS or DFS order after the root, and parent, depth, children and the ancestor mask are
NumPy constants (the shape is a static jit key; the tokens that fill it are traced).

Acceptance walks the tree from the root. Greedy: move to the child whose token is the target argmax,
else emit the argmax and stop. Sampling: recursive rejection sampling over the node's children in
their order (Jeon et al. 2024; SpecInfer's multi-step speculative sampling): with residual r = p and
q_i the distribution the i-th child was drawn from (the drafter's q with the earlier siblings removed
and renormalised: children are drawn without replacement; one-hot for model-free drafters), accept
child i with probability min(1, r(x_i) / q_i(x_i)), else r <- norm(max(r - q_i, 0)) and try the next;
when every child is rejected, emit a draw from r and stop; at a leaf, emit a draw from p (the bonus).
Each emitted token is then distributed exactly as the target's p given its prefix; with one child
per node this is the chain's speculative sampling.

The target's cutoffs (top-p thresholds and normalisers) are found for every verified row in one
call. A level whose nodes have one drafted child reads p and q at that child's token only; so does a
level of one-hot candidates (top-b children, ngram's), whatever their number: after rejecting
candidates x_1..x_i the residual is p without them over 1 - their p, so child i + 1 is accepted with
probability p(x) / (1 - p(x_1) - ... - p(x_i)) (0 for a token already rejected). The residual of the
level where a row stopped is formed once, after the walk: such trees touch whole vocabulary rows
twice (the cutoff, the final draw) instead of several times at every depth.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.sampling import Rules, RowSampling, cutoff, draw, greedy_rows, probs_from_cutoff, row_keys, split_rows, uniform_rows
from jaxspec.errors import JaxspecError

MAX_TREE_ROWS = 64  # verified rows per sequence: the pending token + every node
ORDERS = ("bfs", "dfs")


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """branching (b_1, ..., b_D) and the flattening order; row 0 is the root, rows 1..N the nodes."""

    branching: tuple[int, ...]
    order: str = "bfs"

    def __post_init__(self):
        object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        if not self.branching or min(self.branching) < 1:
            raise JaxspecError(f"a tree needs at least one depth and every branching >= 1, got {self.branching}")
        if self.order not in ORDERS:
            raise JaxspecError(f"--traversal must be bfs or dfs, got {self.order!r}")
        if self.rows > MAX_TREE_ROWS:
            raise JaxspecError(
                f"tree {','.join(map(str, self.branching))} verifies {self.rows} rows; at most {MAX_TREE_ROWS}"
            )

    @classmethod
    def parse(cls, text: str, order: str = "bfs") -> TreeShape:
        """'4,2,1,1' -> TreeShape((4, 2, 1, 1))."""
        try:
            branching = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise JaxspecError(f"--tree must be comma-separated integers such as 4,2,1,1, got {text!r}") from None
        return cls(branching, order)

    @classmethod
    def chain(cls, gamma: int) -> TreeShape:
        return cls((1,) * gamma)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def rows(self) -> int:
        """Verified rows: the root plus sum over depths of the product of the branchings so far."""
        return 1 + int(sum(np.cumprod(self.branching)))

    @property
    def max_branching(self) -> int:
        return max(self.branching)

    @property
    def is_chain(self) -> bool:
        """One child per node: every earlier row is an ancestor, so masks are plain causal ones."""
        return self.max_branching == 1

    def rows_at(self, depth: int) -> np.ndarray:
        """[n] int32: the rows of the nodes at `depth`, in flattened order."""
        return np.flatnonzero(self.node_depth == depth).astype(np.int32)

    def draft_segments(self) -> list[list[int]]:
        """The depths 0 .. D-1 whose nodes draft children, grouped into runs of equal (nodes, branching):
        a run is one `lax.scan` of draft forwards with static shapes (a chain is a single run)."""
        runs: list[list[int]] = []
        key = lambda d: (len(self.rows_at(d)), self.branching[d])
        for d in range(self.depth):
            if runs and key(runs[-1][-1]) == key(d):
                runs[-1].append(d)
            else:
                runs.append([d])
        return runs

    @functools.cached_property
    def parent(self) -> np.ndarray:
        """[rows] int32: each row's parent row (-1 for the root)."""
        return self._layout[0]

    @functools.cached_property
    def node_depth(self) -> np.ndarray:
        """[rows] int32: 0 for the root, d for the drafts of depth d."""
        return self._layout[1]

    @functools.cached_property
    def children(self) -> np.ndarray:
        """[rows, max_branching] int32: each row's child rows in sibling order (-1: none)."""
        kids = np.full((self.rows, self.max_branching), -1, np.int32)
        count = np.zeros(self.rows, np.int32)
        for row in range(1, self.rows):
            p = self.parent[row]
            kids[p, count[p]] = row
            count[p] += 1
        return kids

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        """[rows, rows] bool: row i may attend row j iff j is i or one of its ancestors."""
        mask = np.eye(self.rows, dtype=bool)
        for row in range(1, self.rows):
            mask[row] |= mask[self.parent[row]]
        return mask

    @functools.cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(parent, depth) of every row in the chosen order; siblings keep their rank order."""
        if self.order == "bfs":
            parent, depth, level = [-1], [0], [0]
            for d, b in enumerate(self.branching, start=1):
                nxt = []
                for p in level:
                    for _ in range(b):
                        nxt.append(len(parent))
                        parent.append(p)
                        depth.append(d)
                level = nxt
        else:
            parent, depth = [-1], [0]

            def visit(row: int, d: int) -> None:
                if d == self.depth:
                    return
                for _ in range(self.branching[d]):
                    child = len(parent)
                    parent.append(row)
                    depth.append(d + 1)
                    visit(child, d + 1)

            visit(0, 0)
        return np.asarray(parent, np.int32), np.asarray(depth, np.int32)


@functools.partial(jax.jit, static_argnames=("tree", "backend"))
def tree_accept(
    key: jax.Array,
    tree: TreeShape,
    tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_logits: jax.Array,
    cfg: Rules,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verifies a drafted tree against the target.

    tokens [B, rows] int32: each row's draft token (row 0, the pending token, is not read);
    draft_probs [B, rows, V] float32: at each row, the processed draft distribution its children were
    drawn from (None: one-hot candidates, as for model-free drafters; ignored when greedy, and for
    the greedy rows of row rules, whose candidates are one-hot); key: one per row, or a single key;
    target_logits [B, rows, V]: raw target logits at every row; backend: the kernel backend of the
    target's cutoffs (the one its plain decoding uses).
    Returns (num_accepted [B] int32 in [0, D], path [B, D + 1] int32: the rows of the accepted path,
    root first (entries past num_accepted are the root and unspecified), emitted [B, D + 1] int32: the
    accepted drafts then the recovered or bonus token; entries past num_accepted are unspecified).
    """
    B = tokens.shape[0]
    D, K = tree.depth, tree.max_branching
    children = jnp.asarray(tree.children)
    rows = jnp.arange(B)
    at = lambda x, r: x[rows, r]  # [B, rows, ...] at row r [B]
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)  # every node so far accepted
    num_accepted = jnp.zeros((B,), jnp.int32)
    path = jnp.zeros((B, D + 1), jnp.int32)
    emitted = jnp.zeros((B, D + 1), jnp.int32)
    if cfg.greedy:
        for d in range(D):
            target = jnp.argmax(at(target_logits, cur), axis=-1).astype(jnp.int32)
            kids = children[cur]  # [B, K]
            match = (kids >= 0) & (tokens[rows[:, None], jnp.maximum(kids, 0)] == target[:, None])
            emitted = emitted.at[:, d].set(jnp.where(alive, target, emitted[:, d]))
            step = alive & match.any(axis=1)
            cur = jnp.where(step, kids[rows, jnp.argmax(match, axis=1)], cur)
            path = path.at[:, d + 1].set(cur)
            num_accepted += step
            alive = step
        bonus = jnp.argmax(at(target_logits, cur), axis=-1).astype(jnp.int32)
        emitted = emitted.at[:, D].set(jnp.where(alive, bonus, emitted[:, D]))
        return num_accepted, path, emitted

    keys = split_rows(row_keys(key, B), D * K + 1)
    V = target_logits.shape[-1]
    greedy = jnp.broadcast_to(greedy_rows(cfg, 2), (B, 1))  # row rules' greedy rows: every child a one-hot candidate
    threshold, log_norm = cutoff(target_logits, cfg, backend)  # every row's target cutoff in one call
    # [B, rows]: a greedy row's p is the one-hot of its argmax (row rules only: a config here samples every row)
    top = jnp.argmax(target_logits, axis=-1) if isinstance(cfg, RowSampling) else None
    one_hot = draft_probs is None  # every candidate one-hot: every level is tested at its candidates' tokens only
    narrow = 1 in tree.branching  # some level has one child per node
    q_mass = jnp.sum(draft_probs, axis=-1) if narrow and not one_hot else None  # [B, rows]

    def target(r):
        """p at tree row r [B]: [B, V], as process_logits gives it."""
        probs = probs_from_cutoff(at(target_logits, r), at(threshold, r), at(log_norm, r), cfg)
        return probs if top is None else jnp.where(greedy, jax.nn.one_hot(at(top, r), V, dtype=jnp.float32), probs)

    def target_at(r, x):
        """p at tree row r [B] at tokens x [B, n]: [B, n], without forming the row's p."""
        p_x = probs_from_cutoff(target_logits[rows[:, None], r[:, None], x], threshold[rows, r], log_norm[rows, r], cfg)
        return p_x if top is None else jnp.where(greedy, (x == at(top, r)[:, None]).astype(jnp.float32), p_x)

    def sibling(q, x, mass=None):
        """(q_i [B, V], whether it can be tried [B]): the distribution child token x was drawn from,
        given the draft's q at its parent with the earlier siblings removed (a greedy row's: one-hot);
        `mass` [B], q's sum when already known."""
        # a sibling drawn after q's support ran out is no candidate
        mass = jnp.sum(q, axis=-1, keepdims=True) if mass is None else mass[:, None]
        q_i = jnp.where(greedy, jax.nn.one_hot(x, V, dtype=jnp.float32), q / jnp.maximum(mass, 1e-30))
        return q_i, (mass[:, 0] > 0) | greedy[:, 0]

    def rejected_residual(resid, q_i):
        """norm(max(r - q_i, 0)); zero mass has probability 0 in exact arithmetic: keep r rather than drawing token 0."""
        new = jnp.maximum(resid - q_i, 0.0)
        mass = jnp.sum(new, axis=-1, keepdims=True)
        return jnp.where(mass > 0, new / jnp.where(mass > 0, mass, 1.0), resid)

    final = jnp.zeros((B, V), jnp.float32)  # the stop token's distribution where a level with drafted siblings set it
    token_stop = jnp.zeros((B,), bool)  # stopped at a level tested at its tokens: residual formed once, at the end
    for d in range(D):
        kids = children[cur][:, :tree.branching[d]]
        chosen = jnp.full((B,), -1, jnp.int32)
        if one_hot:  # one-hot siblings: r after rejecting x_1..x_i is p without them, over 1 - their p
            x = tokens[rows[:, None], jnp.maximum(kids, 0)]
            p_x = target_at(cur, x)
            kept = jnp.ones((B,), jnp.float32)  # 1 - the p of the siblings rejected so far: r's normaliser
            for i in range(kids.shape[1]):
                again = functools.reduce(jnp.logical_or, [x[:, j] == x[:, i] for j in range(i)], jnp.zeros((B,), bool))
                p_i = jnp.where(again, 0.0, p_x[:, i])  # a token already rejected has r = 0
                trying = alive & (chosen < 0) & (kids[:, i] >= 0)
                accept = trying & (uniform_rows(keys[d * K + i]) * kept < p_i)  # u < r(x) = p(x) / kept
                chosen = jnp.where(accept, kids[:, i], chosen)
                kept = kept - jnp.where(trying & ~accept, p_i, 0.0)
            token_stop |= alive & (chosen < 0)
        elif tree.branching[d] == 1:  # one drafted child: the test needs p and q at its token only
            x = at(tokens, jnp.maximum(kids[:, 0], 0))
            p_x = target_at(cur, x[:, None])[:, 0]
            mass = at(q_mass, cur)
            q_x = jnp.where(greedy[:, 0], 1.0, draft_probs[rows, cur, x] / jnp.maximum(mass, 1e-30))
            trying = alive & ((mass > 0) | greedy[:, 0])
            accept = trying & (uniform_rows(keys[d * K]) * q_x < p_x)  # u < p/q: q(x) = 0 accepts iff p(x) > 0
            chosen = jnp.where(accept, kids[:, 0], chosen)
            token_stop |= trying & ~accept
        else:  # drafted siblings: each later one is tested against the residual the earlier rejections left
            resid = target(cur)
            q = at(draft_probs, cur)
            for i in range(kids.shape[1]):
                kid = kids[:, i]
                x = at(tokens, jnp.maximum(kid, 0))
                q_i, usable = sibling(q, x)
                trying = alive & (chosen < 0) & (kid >= 0) & usable
                p_x, q_x = resid[rows, x], q_i[rows, x]
                accept = trying & (uniform_rows(keys[d * K + i]) * q_x < p_x)
                chosen = jnp.where(accept, kid, chosen)
                rejected = trying & ~accept
                resid = jnp.where(rejected[:, None], rejected_residual(resid, q_i), resid)
                # the next sibling was drawn without replacement: x is out of its q
                q = jnp.where(rejected[:, None] & (jnp.arange(V) == x[:, None]), 0.0, q)
            final = jnp.where((alive & (chosen < 0))[:, None], resid, final)
        step = alive & (chosen >= 0)
        emitted = emitted.at[:, d].set(jnp.where(step, at(tokens, jnp.maximum(chosen, 0)), emitted[:, d]))
        cur = jnp.where(step, chosen, cur)
        path = path.at[:, d + 1].set(cur)
        num_accepted += step
        alive = step
    # cur is now the leaf (alive rows: the bonus draws from its p) or the node where the row stopped.
    p = target(cur)
    kids = children[cur]
    if one_hot:  # every child of the stop node was tried and rejected: r is p without their tokens (unnormalised:
        # the draw normalises), or p where that leaves no mass (probability 0 in exact arithmetic)
        x = tokens[rows[:, None], jnp.maximum(kids, 0)]
        out = jnp.any((jnp.arange(V) == x[:, :, None]) & (kids >= 0)[:, :, None], axis=1)
        resid = jnp.where(out, 0.0, p)
        final = jnp.where(token_stop[:, None], jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p), final)
    elif narrow:
        q_i, _ = sibling(at(draft_probs, cur), at(tokens, jnp.maximum(kids[:, 0], 0)), at(q_mass, cur))
        final = jnp.where(token_stop[:, None], rejected_residual(p, q_i), final)
    final = jnp.where(alive[:, None], p, final)
    last = draw(keys[-1], final)
    emitted = jnp.where(jnp.arange(D + 1) == num_accepted[:, None], last[:, None], emitted)
    return num_accepted, path, emitted
