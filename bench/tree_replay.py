"""Tokens an iteration of any static draft tree for an EAGLE-3 head, replayed exactly (CPU, float32).

    PYTHONPATH=. python3 bench/tree_replay.py [--heads checkpoints/eagle3-smollm2,DIR] [--new 256]
                                              [--shapes 3,2 3,2,1 ...] [--sizes 6,9,12,15]
                                              [--sampling greedy|sample] [--seeds N] [--oov-ceiling]
                                              [--target-ceiling] [--adaptive 0.5 0.3,0.7 ...]
                                              [--answers FILE.npz] [--out bench/results/tree_replay_cpu.json]

On a greedy text a draft is accepted iff it is the target's argmax, which is the text's next token. On a
text the target sampled, a node whose children are the head's top tokens (eagle's top draws) accepts
one with probability the target's p mass on them: that is the chance the target's own draw, the
text's next token, is among them, and when it is not, the token emitted is that draw. So replaying a
sampled text is exact in distribution, as ngram's replay is. Either way only the tree's nodes along the
text matter: at row t the head's drafts of depth j (EAGLE-3's training-time test teacher-forced on the
text, `models.eagle.ttt_forward`, as inference computes them along an accepted path) rank the text's
token x_{t+j+2} at some r_j; an iteration whose pending token sits at position P accepts the longest
prefix of (r_0, r_1, ...) at row P - 1 that is a node of the tree (a tree is a prefix-closed set of rank
paths: 3,2 is every (a) and (a, b) with a < 3, b < 2). Replaying iteration after iteration over the
target's own answers gives each tree's tokens an iteration without a device, for shapes the engine
does not run: the best tree of n nodes is grown from the calibration answers (a node a rank path,
added in order of how often the text follows it; each node's count bounds its children's, so this is
the most often accepted set of n nodes; `--tree` takes it as per-node counts) and scored on held-out
answers and on generate's default request, with the share of its iterations that stop at a token
outside the head's draft vocabulary (which no tree can draft). `--adaptive` scores trees chosen each
iteration by the head's confidence (its first depth's top probability, known before depth 2 is
drafted): one grown tree per span of confidence, each from the calibration rows in its span, and the
best of them per iteration as a ceiling. `--target-ceiling` scores the trees with the target's own
ranks along the text (the target as its own drafter: what no head drafting its top tokens can pass).
Texts: the target's answers (`--new` tokens; greedy, or `--seeds` answers each sampled at T 0.7, top-p
0.95) to generate's default prompt and to the planner's calibration requests (`corpus.REQUESTS`: the
first half grows the trees, the second half and the default request score them). Writes the JSON and
prints a table last.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench import common
from bench.head_quality import answer
from jaxspec import files
from jaxspec.corpus import REQUESTS
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.tree import TreeShape
from jaxspec.errors import JaxspecError
from jaxspec.generate import DEFAULT_PROMPT
from jaxspec.loaders import load_model
from jaxspec.loaders.eagle import load_eagle
from jaxspec.models import decoder, eagle
from jaxspec.training.eagle import teacher

DEPTH = 4  # draft depths replayed
RANKS = 16  # ranks looked at per depth (a text token ranked lower is never drafted)
OUT = RANKS + 1  # the rank of a text token outside the head's draft vocabulary
PAD = 256  # texts are replayed in lengths of multiples of this
TOPS = (1, 2, 3, 5, 8)  # the first depth's top b reported


def padded(ids: np.ndarray) -> jnp.ndarray:
    """[1, T'] the text padded with its last token to a multiple of PAD: few shapes to compile (each
    compile holds memory); a row reads only tokens up to its own drafts' (past the text: the last
    token, as ttt_forward reads)."""
    return jnp.asarray(np.concatenate([ids, np.full(-len(ids) % PAD, ids[-1], ids.dtype)]))[None]


def ranks(ecfg, head, params, cfg, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([T, DEPTH], [T], [T]): at row t, the rank among the head's (`load_eagle`'s config and weights)
    depth-j drafts of the text's token x_{t+j+2} (RANKS where it is not among the first RANKS or past
    the text, OUT where it is outside the draft vocabulary); the head's confidence at row t, the
    probability (softmax of its logits) of its first depth's top draft, known before depth 2 is drafted;
    and whether that top draft is the target's own top token there (its agreement, as training counts it)."""
    T = len(ids)
    tokens = padded(ids)
    target = teacher(params, cfg, ecfg, head["d2t"], tokens)
    outs = eagle.ttt_forward(head, ecfg, params, cfg, tokens, target.features, DEPTH)
    drafts = np.zeros(cfg.vocab_size, bool)
    drafts[np.asarray(eagle.to_target_ids(head["d2t"], jnp.arange(ecfg.draft_vocab_size)))] = True
    result = np.full((T, DEPTH), RANKS, np.int32)
    confidence, agrees = np.zeros(T, np.float32), np.zeros(T, bool)
    for j in range(DEPTH):
        logits = np.asarray(eagle.draft_logits(head, ecfg, params, cfg, outs[j]))[0, : T - 1]
        order = np.argsort(-logits, axis=-1)[:, :RANKS]
        drafted = np.asarray(eagle.to_target_ids(head["d2t"], jnp.asarray(order)))  # [T - 1, RANKS]
        if j == 0:
            confidence[: T - 1] = 1 / np.exp(logits - logits.max(axis=-1, keepdims=True)).sum(axis=-1)
            agrees[: T - 2] = drafted[: T - 2, 0] == np.asarray(target.argmax)[0, 1 : T - 1]
        rows = np.arange(T - 2 - j)
        hit = drafted[rows] == ids[rows + j + 2, None]
        out = ~drafts[ids[rows + j + 2]]
        result[rows, j] = np.where(hit.any(axis=1), hit.argmax(axis=1), np.where(out, OUT, RANKS))
    return result, confidence, agrees


def target_ranks(params, cfg, ids: np.ndarray) -> np.ndarray:
    """[T, DEPTH]: at row t, the rank of the text's token x_{t+j+2} in the target's own logits at
    position t+j+1 (RANKS where lower or past the text): what a drafter that is the target itself
    ranks along the text, so a tree's tokens an iteration with these ranks bound any head's."""
    T = len(ids)
    logits = np.asarray(decoder.score(params, cfg, padded(ids)))[0, : T - 1]
    higher = (logits > logits[np.arange(T - 1), ids[1:]][:, None]).sum(axis=1)  # x_{s+1}'s rank at position s
    result = np.full((T, DEPTH), RANKS, np.int32)
    for j in range(DEPTH):
        rows = np.arange(T - 2 - j)
        result[rows, j] = np.minimum(higher[rows + j + 1], RANKS)
    return result


def top_shares(first_ranks: np.ndarray) -> dict:
    """The share of first-depth ranks [n] below b, for each b of TOPS (the text's token in the top b)."""
    return {f"text token in the top {b}": round(float(np.mean(first_ranks < b)), 3) for b in TOPS}


def accepted(row_ranks: np.ndarray, tree: set) -> int:
    """Drafts accepted at one row: the longest prefix of its ranks that is a node of `tree`."""
    k = 0
    while k < DEPTH and tuple(row_ranks[: k + 1].tolist()) in tree:
        k += 1
    return k


def replay(texts: dict, trees: list[set], names: list[str], bounds: tuple = (), oracle: bool = False
           ) -> tuple[float, float]:
    """(tokens an iteration, the share of iterations stopped by a token outside the draft vocabulary)
    over the answers of `names` (text -> (ranks, confidence, the answer's first position, T)),
    iterations from the answer's first token on, as generate runs them (the last ones cut at the
    text's end). Each iteration drafts trees[i], i the number of `bounds` at or below the head's
    confidence there (one tree: a static tree); with `oracle`, the best of `trees` (a ceiling)."""
    tokens = iterations = out = 0
    depths = [max(len(path) for path in tree) for tree in trees]
    for name in names:
        rk, confidence, first, T = texts[name]
        pending = first
        while pending < T - 1:
            row = pending - 1
            if oracle:
                i = max(range(len(trees)), key=lambda i: accepted(rk[row], trees[i]))
            else:
                i = int(np.searchsorted(bounds, confidence[row], side="right"))
            whole = accepted(rk[row], trees[i])
            k = min(whole, T - 2 - pending)
            out += k == whole < depths[i] and rk[row, whole] == OUT
            tokens, iterations, pending = tokens + k + 1, iterations + 1, pending + k + 1
    return tokens / iterations, out / iterations


def kept_answers(path: Path | None, run: list) -> dict | None:
    """The answers `keep_answers` wrote at `path` for the same run (model, sampling, seeds, new), or None."""
    if path is None or not path.is_file():
        return None
    with np.load(path) as z:
        if z["run"].tolist() != [str(x) for x in run]:
            return None
        return {(str(name), int(seed)): (z[f"ids {i}"], int(first))
                for i, (name, seed, first) in enumerate(zip(z["names"], z["seeds"], z["firsts"]))}


def keep_answers(path: Path, run: list, answers: dict) -> None:
    """Writes the answers {(name, seed): (ids, first)} and their run to `path` (an .npz, replaced whole)."""
    items = list(answers.items())
    arrays = {f"ids {i}": ids for i, (_, (ids, _)) in enumerate(items)}

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would add .npz to a name
            np.savez(f, run=np.array([str(x) for x in run]), names=np.array([k[0] for k, _ in items]),
                     seeds=np.array([k[1] for k, _ in items]), firsts=np.array([v[1] for _, v in items]), **arrays)

    files.write_file(path, write)


def nodes(text: str) -> set:
    """The rank paths of a --tree shape's nodes ('3,2', '5,3+1')."""
    return set(TreeShape.parse(text).rank_paths[1:])


def shape_text(tree: set) -> str | None:
    """The --tree text of a set of rank paths, or None where a node's children are not its ranks 0..c-1."""
    depth = max(len(path) for path in tree)
    level, branching = [()], []
    for d in range(1, depth + 1):
        counts = [sum(1 for path in tree if len(path) == d and path[:-1] == parent) for parent in level]
        branching.append(tuple(counts) if len(set(counts)) > 1 else counts[0])
        level = sorted(path for path in tree if len(path) == d)
    shape = TreeShape(tuple(branching))
    return shape.text if set(shape.rank_paths[1:]) == tree else None


def grown(texts: dict, names: list[str], size: int, depth: int, span: tuple = (0.0, 2.0)) -> set:
    """The `size` nodes of depth <= `depth` the answers of `names` follow most often (prefix-closed),
    counted at the rows whose head confidence lies in [span[0], span[1])."""
    count = collections.Counter()
    for name in names:
        rk, confidence, first, T = texts[name]
        for t in range(first - 1, T - 1):
            if not span[0] <= confidence[t] < span[1]:
                continue
            for d in range(1, depth + 1):
                if rk[t, d - 1] >= RANKS:
                    break
                count[tuple(rk[t, :d].tolist())] += 1
    tree: set = set()
    while len(tree) < size:
        open_ = [(c, path) for path, c in count.items() if path not in tree and (len(path) == 1 or path[:-1] in tree)]
        if not open_:
            break
        tree.add(max(open_)[1])
    return tree


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="checkpoints/eagle3-smollm2", help="head directories, comma-separated")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--new", type=int, default=256, help="tokens of each answer")
    p.add_argument("--shapes", nargs="*", default=["2,1", "3,2", "3,2,1", "4,2,1", "6,2", "5,3+1"],
                   help="--tree shapes to score")
    p.add_argument("--sampling", choices=("greedy", "sample"), default="greedy",
                   help="the answers: greedy, or sampled at T 0.7, top-p 0.95 (for top draws)")
    p.add_argument("--seeds", type=int, default=1, help="sampled answers to each prompt")
    p.add_argument("--oov-ceiling", action="store_true",
                   help="also score each --shapes tree with every text token outside the draft vocabulary ranked "
                        "first: what a whole-vocabulary head of this head's quality could reach at most")
    p.add_argument("--target-ceiling", action="store_true",
                   help="also score each --shapes tree with the target's own ranks: the tokens an iteration that no "
                        "head can pass with top drafts")
    p.add_argument("--sizes", default="6,9,12,15", type=lambda s: [int(n) for n in s.split(",")],
                   help="node counts of the grown trees (each at depths 2, 3 and 4)")
    p.add_argument("--adaptive", nargs="*", default=[], type=lambda s: tuple(float(b) for b in s.split(",")),
                   help="confidence bounds (comma-separated, rising): per --sizes, one grown tree for each span of the "
                        "head's first-depth top probability, each iteration drafting its span's tree")
    p.add_argument("--answers", type=Path, default=None,
                   help="the target's answers kept in this .npz: read if it holds this run's (model, sampling, "
                        "seeds, --new), else generated and written (most of a run's time is generating them)")
    p.add_argument("--out", type=Path, default=common.RESULTS / "tree_replay_cpu.json")
    args = p.parse_args(argv)
    for shape in args.shapes:
        try:
            tree = TreeShape.parse(shape)
        except JaxspecError as e:
            p.error(str(e))
        if tree.depth > DEPTH or tree.max_branching > RANKS:  # deeper: past the ranks' columns; wider: never drafted
            p.error(f"--shapes {shape}: the replay ranks {RANKS} drafts a node at {DEPTH} depths")
    cfg, params, tokenizer = load_model(args.model, dtype="float32")
    template = lambda prompt: tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                            add_generation_prompt=True)
    prompts = {"default": DEFAULT_PROMPT, **{f"request {i}": r for i, r in enumerate(REQUESTS)}}
    sampling = SamplingConfig() if args.sampling == "greedy" else SamplingConfig(temperature=0.7, top_p=0.95)
    seeds = range(args.seeds if args.sampling == "sample" else 1)
    run = [args.model, args.sampling, len(seeds), args.new]  # what the answers depend on
    answers = kept_answers(args.answers, run)
    if answers is None:
        answers = {(name, seed): answer(params, cfg, tokenizer, template(prompt), args.new, sampling, seed=seed)
                   for name, prompt in prompts.items() for seed in seeds}
        if args.answers is not None:
            keep_answers(args.answers, run, answers)
    half = len(REQUESTS) // 2
    of = lambda names: [(name, seed) for name in names for seed in seeds]
    groups = {"calibration": of(f"request {i}" for i in range(half)),
              "held-out": of(f"request {i}" for i in range(half, len(REQUESTS))), "default": of(["default"])}
    rows, record = [], {}
    at = lambda name: slice(answers[name][1] - 1, len(answers[name][0]) - 2)  # rows predicting answer tokens
    for head in args.heads.split(","):
        ecfg, weights = load_eagle(Path(head), cfg, dtype="float32")
        scored = {name: ranks(ecfg, weights, params, cfg, ids) for name, (ids, _) in answers.items()}
        texts = {name: (rk, confidence, answers[name][1], len(answers[name][0]))
                 for name, (rk, confidence, _) in scored.items()}
        for group, names in groups.items():  # the first depth over the answers' tokens after their first
            agree = np.concatenate([scored[name][2][at(name)] for name in names])
            shares = top_shares(np.concatenate([scored[name][0][at(name), 0] for name in names]))
            record[f"{head} | first depth, {group}"] = {"positions": len(agree),
                                                       "agreement": round(float(agree.mean()), 3), **shares}
            print(f"{Path(head).name}, {group}: {len(agree)} positions, the head's top draft is the target's top "
                  f"token at {agree.mean():.3f}; {shares}")
        trees = {s: nodes(s) for s in args.shapes}
        if args.oov_ceiling:
            ceiling = {name: (np.where(rk == OUT, 0, rk), *rest) for name, (rk, *rest) in texts.items()}
            for shape, tree in trees.items():
                scores = {g: replay(ceiling, [tree], names) for g, names in groups.items()}
                rows.append({"head": Path(head).name, "tree": f"{shape}, out-of-vocabulary tokens ranked first",
                             "shape": shape, **{g: round(tpi, 3) for g, (tpi, _) in scores.items()}})
                record[f"{head} | {rows[-1]['tree']}"] = rows[-1]
        if args.target_ceiling and head == args.heads.split(",")[0]:  # the same for every head
            own = {name: (target_ranks(params, cfg, ids), texts[name][1], first, len(ids))
                   for name, (ids, first) in answers.items()}
            for group, names in groups.items():  # the first depth, as for the head above
                shares = top_shares(np.concatenate([own[name][0][at(name), 0] for name in names]))
                record[f"the target itself | first depth, {group}"] = shares
                print(f"the target itself, {group}: {shares}")
            for shape, tree in trees.items():
                scores = {g: replay(own, [tree], names) for g, names in groups.items()}
                rows.append({"head": "the target itself", "tree": f"{shape}, the target's own top drafts (ceiling)",
                             "shape": shape, **{g: round(tpi, 3) for g, (tpi, _) in scores.items()}})
                record[rows[-1]["tree"]] = rows[-1]
        trees |= {f"grown {n} nodes, depth <= {d}": grown(texts, groups["calibration"], n, d)
                  for n in args.sizes for d in (2, 3, 4)}
        for name, tree in trees.items():
            scores = {g: replay(texts, [tree], names) for g, names in groups.items()}
            depth = max(len(path) for path in tree)
            rows.append({"head": Path(head).name, "tree": name, "shape": shape_text(tree), "nodes": len(tree),
                         "depth": depth,
                         **{g: round(tpi, 3) for g, (tpi, _) in scores.items()},
                         "default out of vocabulary": round(scores["default"][1], 3)})
            record[f"{head} | {name}"] = {**rows[-1], "paths": sorted(sorted(tree), key=len)}
        for n in args.sizes:
            for bounds in args.adaptive:
                spans = list(zip((0.0, *bounds), (*bounds, 2.0)))
                chosen = [grown(texts, groups["calibration"], n, DEPTH, span) for span in spans]
                for oracle in (False, True):
                    scores = {g: replay(texts, chosen, names, bounds, oracle) for g, names in groups.items()}
                    name = f"{n} nodes by confidence {','.join(map(str, bounds))}"
                    name += ", best (ceiling)" if oracle else ""
                    rows.append({"head": Path(head).name, "tree": name,
                                 "shape": " | ".join(str(shape_text(tree)) for tree in chosen), "nodes": n,
                                 "depth": max(len(path) for tree in chosen for path in tree),
                                 **{g: round(tpi, 3) for g, (tpi, _) in scores.items()},
                                 "default out of vocabulary": round(scores["default"][1], 3)})
                    record[f"{head} | {name}"] = {**rows[-1], "paths": [sorted(sorted(t), key=len) for t in chosen]}
    lengths = {f"{name} seed {seed}": int(len(ids) - first) for (name, seed), (ids, first) in answers.items()}
    common.write_json(args.out, {**common.run_info(), "sampling": args.sampling, "answers": lengths, "trees": record})
    print(common.markdown_table(rows, [("head", "head", "s"), ("tree", "tree", "s"), ("shape", "shape", "s"),
                                       ("nodes", "nodes", "d"),
                                       ("depth", "depth", "d"), ("calibration", "calibration", ".3f"),
                                       ("held-out", "held-out", ".3f"), ("default request", "default", ".3f"),
                                       ("default: stops outside the vocabulary", "default out of vocabulary", ".3f")]))


if __name__ == "__main__":
    main()
