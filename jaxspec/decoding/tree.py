"""Static draft trees and their exact acceptance (docs/architecture.md, "Draft trees").

A tree's shape is its branching per depth, b_1..b_D: the root (the pending token, verify row 0) has b_1
children, each of those b_2, and so on; a chain of gamma drafts is the tree (1, ..., 1). A depth may
instead give each node of the depth above its own number of children (5,3+1: the root's first child
has 3, its second 1, the rest none), so the rows go where a drafter's ranks are followed. Nodes are
flattened in BFS or DFS order after the root, and parent, depth, children and the ancestor mask are
NumPy constants (the shape is a static jit key; the tokens that fill it are traced).

Acceptance walks the tree from the root. Greedy: move to the child whose token is the target argmax,
else emit the argmax and stop. Sampling: recursive rejection sampling over the node's children in
their order (Jeon et al. 2024; SpecInfer's multi-step speculative sampling): with residual r = p and
q_i the distribution the i-th child was drawn from (the drafter's q with the earlier siblings removed
and renormalised: children are drawn without replacement; one-hot for model-free drafters), accept
child i with probability min(1, r(x_i) / q_i(x_i)), else r <- norm(max(r - q_i, 0)) and try the next;
when every child is rejected, emit a draw from r and stop; at a leaf (a node of any depth without
children), emit a draw from p (the bonus).
Each emitted token is then distributed exactly as the target's p given its prefix; with one child
per node this is the chain's speculative sampling.

The target's cutoffs (top-p thresholds and normalisers) are found for every verified row in one
call. A level whose nodes have one drafted child reads p and q at that child's token only; so does a
level of one-hot candidates (top-b children, ngram's), whatever their number: after rejecting
candidates x_1..x_i the residual is p without them over 1 - their p, so child i + 1 is accepted with
probability p(x) / (1 - p(x_1) - ... - p(x_i)) (0 for a token already rejected), and a level's
candidates are tested at once: child i passes iff u_i (1 - p(x_1) - ... - p(x_{i-1})) < p(x_i), and the
first that passes is taken, as trying them in order takes it. The residual of the level where a row
stopped is formed once, after the walk: such trees touch whole vocabulary rows twice (the cutoff, the
final draw) instead of several times at every depth. Every test's uniform u is drawn in one call.
A level of drafted siblings keeps its residual as one scalar C a row: after rejecting x_1..x_i,
r = max(p - C q, 0) / S, where each rejection adds S / m to C (m: q's mass not yet tried, so q_i =
q / m off the tried tokens) and S is the new sum. A rejected x_i had r(x_i) <= q_i(x_i), so it is 0
in every later residual, as removing it from q requires; so a sibling is tested from p and q at its
token and one sum over the vocabulary, and the residual where a row stopped is formed once.
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
    """The tree's branching per depth and its flattening order; row 0 is the root, rows 1..N the nodes.

    A depth's branching is a number b (every node of the depth above has b children: the uniform
    tree b_1..b_D) or a tuple (c_1, ..., c_n): the children of each node of the depth above, in rank
    order (c_1 for the most likely), none for the nodes past its end. So (5, (3, 1)) is a root of 5
    children whose first has 3 children and second 1: 9 nodes, as 3,2 has, placed where a head's
    drafts are accepted most often (bench/tree_replay.py)."""

    branching: tuple[int | tuple[int, ...], ...]
    order: str = "bfs"

    def __post_init__(self):
        if not self.branching:
            raise JaxspecError("a tree needs at least one depth")
        if self.order not in ORDERS:
            raise JaxspecError(f"--traversal must be bfs or dfs, got {self.order!r}")
        text = branching_text(self.branching)
        branching, nodes, rows = [], 1, 1  # counted before the rows are listed: too large a tree is an error
        for b in self.branching:
            b = _depth_branching(b, nodes)
            if isinstance(b, tuple) and len(b) > nodes:
                raise JaxspecError(f"tree {text}: {len(b)} children counts for a depth of {nodes} nodes")
            branching.append(b)
            nodes = b * nodes if isinstance(b, int) else sum(b)
            rows += nodes
            if rows > MAX_TREE_ROWS:
                raise JaxspecError(f"tree {text} verifies more than {MAX_TREE_ROWS} rows")
        object.__setattr__(self, "branching", tuple(branching))

    @classmethod
    def parse(cls, text: str, order: str = "bfs") -> TreeShape:
        """'4,2,1,1' -> TreeShape((4, 2, 1, 1)); '5,3+1' -> TreeShape((5, (3, 1)))."""
        try:
            branching = tuple(tuple(int(n) for n in part.split("+")) if "+" in part else int(part)
                              for part in text.split(","))
        except ValueError:
            raise JaxspecError(f"--tree must be comma-separated branchings such as 4,2,1,1 or 5,3+1 (children of "
                               f"each node), got {text!r}") from None
        return cls(branching, order)

    @classmethod
    def chain(cls, gamma: int) -> TreeShape:
        return cls((1,) * gamma)

    @property
    def text(self) -> str:
        """The branching as --tree takes it: '3,2', '5,3+1'."""
        return branching_text(self.branching)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def rows(self) -> int:
        """Verified rows: the root and every node."""
        return len(self.rank_paths)

    @functools.cached_property
    def widths(self) -> tuple[int, ...]:
        """Per depth, the most children a node of the depth above has: the drafts it takes per node."""
        return tuple(b if isinstance(b, int) else max(b) for b in self.branching)

    @property
    def max_branching(self) -> int:
        return max(self.widths)

    @property
    def is_chain(self) -> bool:
        """One node per depth: every earlier row is an ancestor, so masks are plain causal ones."""
        return self.rows == self.depth + 1

    def rows_at(self, depth: int) -> np.ndarray:
        """[n] int32: the rows of the nodes at `depth`, in flattened order."""
        return np.flatnonzero(self.node_depth == depth).astype(np.int32)

    def parents_at(self, depth: int) -> np.ndarray:
        """[n] int32: the rows of the nodes at `depth` that have children (those a drafter runs)."""
        rows = self.rows_at(depth)
        return rows[self.children[rows, 0] >= 0]

    def draft_segments(self) -> list[list[int]]:
        """The depths 0 .. D-1 whose nodes draft children, grouped into runs of equal (parents, width):
        a run is one `lax.scan` of draft forwards with static shapes (a chain is a single run)."""
        runs: list[list[int]] = []
        key = lambda d: (len(self.parents_at(d)), self.widths[d])
        for d in range(self.depth):
            if runs and key(runs[-1][-1]) == key(d):
                runs[-1].append(d)
            else:
                runs.append([d])
        return runs

    def kids(self, rows: np.ndarray) -> np.ndarray:
        """[..., width] int32: the child rows of `rows` (of one width: a depth's, or a drafting segment's
        depths of equal width) in sibling order, where a drafter scatters their tokens; `self.rows`, out
        of range, where a node has fewer children than the width (a scatter with mode="drop" leaves it out)."""
        rows = np.asarray(rows)
        widths = {self.widths[int(d)] for d in np.unique(self.node_depth[rows])}
        assert len(widths) == 1, f"kids of rows of widths {sorted(widths)}"
        kids = self.children[rows][..., : widths.pop()]
        return np.where(kids < 0, self.rows, kids)

    @functools.cached_property
    def parent(self) -> np.ndarray:
        """[rows] int32: each row's parent row (-1 for the root)."""
        index = {path: row for row, path in enumerate(self.rank_paths)}
        return np.asarray([index.get(path[:-1], -1) if path else -1 for path in self.rank_paths], np.int32)

    @functools.cached_property
    def node_depth(self) -> np.ndarray:
        """[rows] int32: 0 for the root, d for the drafts of depth d."""
        return np.asarray([len(path) for path in self.rank_paths], np.int32)

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
    def rank_paths(self) -> list[tuple[int, ...]]:
        """Every row's rank path (the root's is ()) in the chosen order; siblings keep their rank order.
        BFS lists the depths in turn; DFS is the paths' lexicographic order (a node, then its subtrees)."""
        level, paths = [()], [()]
        for b in self.branching:
            counts = [b] * len(level) if isinstance(b, int) else list(b) + [0] * (len(level) - len(b))
            level = [path + (rank,) for path, n in zip(level, counts) for rank in range(n)]
            paths += level
        return paths if self.order == "bfs" else sorted(paths)


def _depth_branching(b, nodes: int) -> int | tuple[int, ...]:
    """One depth's branching below `nodes` nodes, checked: a number >= 1, or per-node counts >= 0 with
    one child at least (trailing zeros dropped: nodes without children; one count for every node, all
    equal, is that number: 3,2+2+2 is 3,2, so one tree has one name, one table entry and one compile)."""
    if isinstance(b, (list, tuple)):
        counts = tuple(int(n) for n in b)
        while counts and counts[-1] == 0:
            counts = counts[:-1]
        if not counts or min(counts) < 0:
            raise JaxspecError(f"a depth's children counts need one child at least and none below 0, got {b}")
        return counts[0] if len(counts) == nodes and len(set(counts)) == 1 else counts
    if int(b) < 1:
        raise JaxspecError(f"a tree needs every branching >= 1, got {b}")
    return int(b)


def branching_text(branching) -> str:
    """(5, (3, 1)) -> '5,3+1', (2, (1,), 1) -> '2,1+0,1': a branching as --tree takes it (per-node counts
    always with a '+', so they do not read back as a number for every node)."""
    node_counts = lambda b: "+".join(map(str, b if len(b) > 1 else (*b, 0)))
    return ",".join(node_counts(b) if isinstance(b, (list, tuple)) else str(b) for b in branching)


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
    root first (entries past num_accepted unspecified), emitted [B, D + 1] int32: the
    accepted drafts then the recovered or bonus token; entries past num_accepted are unspecified).
    """
    B = tokens.shape[0]
    D, K, widths = tree.depth, tree.max_branching, tree.widths
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

    draw_key, uniform_key = split_rows(row_keys(key, B), 2)
    u = uniform_rows(uniform_key, (D, K))  # [B, D, K]: the test of child i at depth d, every one drawn at once
    V = target_logits.shape[-1]
    greedy = jnp.broadcast_to(greedy_rows(cfg, 2), (B, 1))  # row rules' greedy rows: every child a one-hot candidate
    threshold, log_norm = cutoff(target_logits, cfg, backend)  # every row's target cutoff in one call
    # [B, rows]: a greedy row's p is the one-hot of its argmax (row rules only: a config here samples every row)
    top = jnp.argmax(target_logits, axis=-1) if isinstance(cfg, RowSampling) else None
    one_hot = draft_probs is None  # every candidate one-hot: every level is tested at its candidates' tokens only
    narrow = 1 in widths  # some level has one child per node at most
    q_mass = jnp.sum(draft_probs, axis=-1) if narrow and not one_hot else None  # [B, rows]

    def target(r):
        """p at tree row r [B]: [B, V], as process_logits gives it."""
        probs = probs_from_cutoff(at(target_logits, r), at(threshold, r), at(log_norm, r), cfg)
        return probs if top is None else jnp.where(greedy, jax.nn.one_hot(at(top, r), V, dtype=jnp.float32), probs)

    def target_at(r, x):
        """p at tree row r [B] at tokens x [B, n]: [B, n], without forming the row's p."""
        p_x = probs_from_cutoff(target_logits[rows[:, None], r[:, None], x], threshold[rows, r], log_norm[rows, r], cfg)
        return p_x if top is None else jnp.where(greedy, (x == at(top, r)[:, None]).astype(jnp.float32), p_x)

    final = jnp.zeros((B, V), jnp.float32)  # the stop token's distribution where a level with drafted siblings set it
    token_stop = jnp.zeros((B,), bool)  # stopped at a level tested at its tokens: residual formed once, at the end
    leaf = jnp.zeros((B,), bool)  # reached a node without children above the last depth: the bonus, from its p
    for d in range(D):
        kids = children[cur][:, :widths[d]]
        leaf |= alive & (kids[:, 0] < 0)
        chosen = jnp.full((B,), -1, jnp.int32)
        if one_hot:  # one-hot siblings: r after rejecting x_1..x_i is p without them, over 1 - their p
            x = tokens[rows[:, None], jnp.maximum(kids, 0)]
            n = kids.shape[1]
            again = jnp.any((x[:, :, None] == x[:, None, :]) & np.tri(n, n, -1, bool), axis=2)  # tried before
            p_i = jnp.where(again | (kids < 0), 0.0, target_at(cur, x))  # a token already rejected has r = 0
            kept = 1.0 - (jnp.cumsum(p_i, axis=1) - p_i)  # r's normaliser at child i: 1 - the p rejected before it
            accept = (kids >= 0) & (u[:, d, :n] * kept < p_i)  # u < r(x) = p(x) / kept; the first such child
            chosen = jnp.where(alive & accept.any(axis=1), kids[rows, jnp.argmax(accept, axis=1)], chosen)
            token_stop |= alive & (chosen < 0)
        elif widths[d] == 1:  # one drafted child: the test needs p and q at its token only
            x = at(tokens, jnp.maximum(kids[:, 0], 0))
            p_x = target_at(cur, x[:, None])[:, 0]
            mass = at(q_mass, cur)
            q_x = jnp.where(greedy[:, 0], 1.0, draft_probs[rows, cur, x] / jnp.maximum(mass, 1e-30))
            trying = alive & (kids[:, 0] >= 0) & ((mass > 0) | greedy[:, 0])
            accept = trying & (u[:, d, 0] * q_x < p_x)  # u < p/q: q(x) = 0 accepts iff p(x) > 0
            chosen = jnp.where(accept, kids[:, 0], chosen)
            token_stop |= trying & ~accept
        else:  # drafted siblings: each later one is tested against the residual the earlier rejections left,
            # max(p - C q, 0) / S with one scalar C a row (module docstring)
            p_row, q = target(cur), at(draft_probs, cur)
            x = tokens[rows[:, None], jnp.maximum(kids, 0)]  # [B, n]
            p_x, q_x = target_at(cur, x), q[rows[:, None], x]
            g = greedy[:, 0]  # a greedy row's candidates are one-hot: its r stays p, C stays 0
            c, s = jnp.zeros((B,), jnp.float32), jnp.ones((B,), jnp.float32)  # r = p at first
            m = jnp.sum(q, axis=-1) if q_mass is None else at(q_mass, cur)  # q's mass not yet tried
            for i in range(kids.shape[1]):
                # a sibling drawn after q's support ran out (q 0 at its token) is no candidate
                trying = alive & (chosen < 0) & (kids[:, i] >= 0) & ((q_x[:, i] > 0) | g)
                m_i = jnp.maximum(m, jnp.maximum(q_x[:, i], 1e-30))  # q_i = q / m_i off the tried tokens
                accept = trying & (u[:, d, i] * jnp.where(g, 1.0, q_x[:, i] / m_i) * s
                                   < jnp.maximum(p_x[:, i] - c * q_x[:, i], 0.0))  # u < r(x) / q_i(x)
                chosen = jnp.where(accept, kids[:, i], chosen)
                rejected = trying & ~accept
                c_new = jnp.where(g, c, c + s / m_i)
                s_new = jnp.sum(jnp.maximum(p_row - c_new[:, None] * q, 0.0), axis=-1)
                moved = rejected & (s_new > 0)  # zero mass has probability 0 in exact arithmetic: keep r
                c, s = jnp.where(moved, c_new, c), jnp.where(moved, s_new, s)
                m = jnp.where(rejected, m - q_x[:, i], m)  # the next sibling was drawn without replacement
            resid = jnp.maximum(p_row - c[:, None] * q, 0.0)  # unnormalised: the draw normalises
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
    if one_hot or narrow:  # a row stopped at a level tested at its tokens: its residual r, unnormalised (the
        # draw normalises), or p where r has no mass (probability 0 in exact arithmetic: not drawing token 0)
        if one_hot:  # every child of the stop node was tried and rejected: r is p without their tokens
            x = tokens[rows[:, None], jnp.maximum(kids, 0)]
            out = jnp.any((jnp.arange(V) == x[:, :, None]) & (kids >= 0)[:, :, None], axis=1)
            resid = jnp.where(out, 0.0, p)
        else:  # one drafted child rejected: r = max(p - q / m, 0) (a greedy row's: p, its child not the argmax)
            c = jnp.where(greedy[:, 0], 0.0, 1.0 / jnp.maximum(at(q_mass, cur), 1e-30))
            resid = jnp.maximum(p - c[:, None] * at(draft_probs, cur), 0.0)
        final = jnp.where(token_stop[:, None], jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p), final)
    final = jnp.where((alive | leaf)[:, None], p, final)
    last = draw(draw_key, final)
    emitted = jnp.where(jnp.arange(D + 1) == num_accepted[:, None], last[:, None], emitted)
    return num_accepted, path, emitted
