"""The planner (`--method auto`): tables, the cost model, refinement, switching strategy mid-run
without changing the output, the CLI and the profiler."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import generate, profile
from jaxspec import planner
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, draft_weights
from jaxspec.models.config import ModelConfig, MoEConfig, NSAConfig
from jaxspec.models.eagle import EagleConfig
from jaxspec.planner import cost, refine, tables
from jaxspec.planner.plan import ERRORS, choose, median_error, paid_copies, pessimistic
from jaxspec.planner.refine import Observation
from jaxspec.planner.strategy import Prediction, Strategy
from jaxspec.runner import run_generation, summarize
from jaxspec.serving import programs
from jaxspec.serving.scheduler import LOAD_CALLS

PLAIN = Strategy()
VEGAS = Strategy("vegas", gamma=6, ratio=0.07)
NGRAM = Strategy("ngram", gamma=4)
TREE = Strategy("vegas", tree=(3, 2, 1), traversal="dfs", ratio=0.03)
NODES = Strategy("vegas", tree=(5, (3, 1)), traversal="bfs", ratio=0.07)
APPROX = Strategy("vegas", gamma=4, ratio=0.07, precision="approx", group=4)
FULL_INT8 = Strategy("full", gamma=6, draft_weights="int8")
SPACED = Strategy("vegas", gamma=6, ratio=0.07, select_every=2)
SHARED = Strategy("vegas", gamma=10, ratio=0.07, select_every=2, balance=2.0)

SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=1536, dtype="bfloat16", max_position_embeddings=8192)
QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=12288, dtype="bfloat16", qk_norm=True, max_position_embeddings=40960)
SMOLLM2_HEAD = EagleConfig(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                           draft_vocab_size=12288, vocab_size=49152, target_hidden_size=576, feature_layers=(2, 15, 27))


def entry(strategy: Strategy, tokens_per_s: float, tpi: float, batch: int = 1) -> dict:
    return {"strategy": strategy.to_json(), "tokens_per_s": tokens_per_s, "tokens_per_iteration": tpi,
            "iteration_s": batch * tpi / tokens_per_s, "runs": 3, "spread_tokens_per_s": 1.0}


def table(cfg=SMOLLM2, cells=None) -> dict:
    t = tables.new_table(cfg, "test", "cpu", "reference", {"new_tokens": 8})
    for cell in cells or [(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), entry(VEGAS, 700, 5)])]:
        tables.set_cell(t, *cell)
    return t


def test_strategy_json_round_trip_and_spec():
    for s in (PLAIN, VEGAS, NGRAM, TREE, APPROX, FULL_INT8, SPACED, SHARED, NODES):
        assert Strategy.from_json(json.loads(json.dumps(s.to_json()))) == s
    # a tree whose nodes each have their own children: named as --tree takes it, applied as given
    assert NODES.name == "vegas bfs:5,3+1 r0.07" and NODES.spec(SpecConfig()).shape.rows == 10
    # selections spaced out: named, applied, canonical (every 1 is None, so a table written before the
    # field, whose entries lack it, reads as every 1)
    assert SPACED.name == "vegas g6 r0.07 every 2" and SPACED.spec(SpecConfig()).select_every == 2
    assert Strategy.of(SPACED.spec(SpecConfig())) == SPACED and VEGAS.spec(SpecConfig(select_every=3)).select_every == 1
    assert Strategy.of(SpecConfig(method="vegas", gamma=6, ratio=0.07, select_every=1)) == VEGAS
    assert Strategy("vegas", gamma=6, ratio=0.07, select_every=1) == VEGAS and hash(Strategy(select_every=1)) == hash(PLAIN)
    assert "select_every" not in VEGAS.to_json() and SPACED.to_json()["select_every"] == 2  # old readers take the default
    for bad in (0, 2.0, "2", False, 9):
        with pytest.raises(JaxspecError, match="select-every"):
            Strategy.from_json({**VEGAS.to_json(), "select_every": bad})
    with pytest.raises(JaxspecError, match="select-every"):
        Strategy("stream", gamma=6, ratio=0.07, select_every=2).spec(SpecConfig())
    # a shared budget likewise: named, applied, canonical (balance 1 is None), sparse methods only
    assert SHARED.name == "vegas g10 r0.07 every 2 balance 2" and SHARED.spec(SpecConfig()).balance == 2.0
    assert Strategy.of(SHARED.spec(SpecConfig())) == SHARED and Strategy.of(SpecConfig(method="vegas", gamma=6, ratio=0.07)) == VEGAS
    assert Strategy("vegas", gamma=6, ratio=0.07, balance=1.0) == VEGAS and "balance" not in VEGAS.to_json()
    assert Strategy.of(SpecConfig(method="stream", balance=2.0)).balance == 2.0
    for bad in (0.5, "2", True, 9, float("nan")):
        with pytest.raises(JaxspecError, match="balance"):
            Strategy.from_json({**VEGAS.to_json(), "balance": bad})
    with pytest.raises(JaxspecError, match="balance"):
        Strategy("ngram", gamma=4, balance=2.0).spec(SpecConfig())
    assert FULL_INT8.name == "full g6 int8" and FULL_INT8.spec(SpecConfig()).draft_weights == "int8"
    assert Strategy.of(TREE.spec(SpecConfig(backend="pallas"))) == TREE
    spec = TREE.spec(SpecConfig(backend="pallas", min_tokens=64))
    assert (spec.method, spec.tree, spec.traversal, spec.gamma, spec.ratio, spec.min_tokens) == ("vegas", (3, 2, 1), "dfs", 3, 0.03, 64)
    assert (PLAIN.name, VEGAS.name, TREE.name, APPROX.name) == ("plain", "vegas g6 r0.07", "vegas dfs:3,2,1 r0.03", "vegas g4 r0.07 approx group 4")
    with pytest.raises(JaxspecError):
        Strategy.from_json({"method": "vegas", "gamma": 0})


def test_table_round_trip_and_bad_files(tmp_path):
    t = table(cells=[(1, "greedy", 1024, "strict", [entry(VEGAS, 700, 5), entry(PLAIN, 900, 1)]),
                     (4, "sample", 8192, "strict", [entry(PLAIN, 2000, 1, 4), entry(TREE, 2500, 3.5, 4)])])
    path = tmp_path / "t.json"
    tables.save_table(path, t)
    assert tables.load_table(path) == t
    assert [e["strategy"]["method"] for e in t["cells"][0]["ranked"]] == ["plain", "vegas"]  # ranked on insertion
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file is gone
    bad = {
        "truncated": path.read_text()[:200],
        "not a table": "[1, 2]",
        "no plain": json.dumps(table(cells=[(1, "greedy", 1024, "strict", [entry(VEGAS, 700, 5)])])),
        "bad strategy": path.read_text().replace('"vegas"', '"medusa"'),
        "bad format": path.read_text().replace('"format": 1', '"format": 7'),
    }
    for name, text in bad.items():
        path.write_text(text)
        with pytest.raises(JaxspecError, match="cannot read planner table") as info:
            tables.load_table(path)
        assert "\n" not in str(info.value), name


def test_buckets_and_nearest_lookup():
    assert [tables.bucket_of(n) for n in (10, 1024, 1025, 5000, 10**6)] == [1024, 1024, 2048, 8192, 131072]
    t = table(cells=[(b, "greedy", bucket, "strict", [entry(PLAIN, 100 * b + bucket / 1024, 1, b)])
                     for b in (1, 8) for bucket in (1024, 8192)])
    assert tables.lookup(t, 1, "greedy", 900)[0] == 1024
    assert tables.lookup(t, 1, "greedy", 3000)[0] == 8192  # 4096 is one doubling from 8192, two from 1024
    assert tables.lookup(t, 1, "greedy", 1500)[0] == 1024
    bucket, predictions = tables.lookup(t, 6, "sample", 12000)  # nearest batch (8), the other sampling mode
    assert bucket == 8192 and predictions[0].tokens_per_s == 808 * 6 / 8  # its rate per row, for 6 rows
    assert (predictions[0].spread, predictions[0].iteration_s) == (6 / 8, 8 / 808)
    assert tables.lookup(t, 32, "greedy", 1000) == (1024, [])  # batch 8 is 4x away: another regime, the cost model's
    assert tables.lookup(t, 8, "greedy", 40000) == (65536, [])  # so is a bucket 8x past the nearest profiled one
    # the tail: the cell's closed-batch tokens per iteration (its tokens/s times its iteration time,
    # per row of the cell) over its mean row's
    assert predictions[0].tail == pytest.approx(1.0)
    t["cells"][3]["ranked"][0]["iteration_s"] *= 0.6  # 8 rows at 808 tok/s gain 0.6 tokens a row iteration
    assert tables.lookup(t, 6, "sample", 12000)[1][0].tail == pytest.approx(0.6)
    # a run 4x the cell's length: a model drafter's slowest-row excess halves (1 / sqrt of the
    # tokens), its rate with it; ngram's (its rows differ for good) and plain's stay
    cell = t["cells"][3]
    cell["new_tokens"], cell["ranked"] = 256, [entry(PLAIN, 808, 1, 8), entry(VEGAS, 1600, 5, 8), entry(NGRAM, 1200, 2, 8)]
    for e in cell["ranked"][1:]:
        e["iteration_s"] *= 0.6  # tails of 0.6: excess 2/3 over 256 tokens, 1/3 over 1,024
    by = {p.strategy: p for p in tables.lookup(t, 8, "sample", 12000, new_tokens=1024)[1]}
    assert (by[VEGAS].tail, by[VEGAS].tokens_per_s) == (pytest.approx(0.75), pytest.approx(1600 * 0.75 / 0.6))
    assert (by[NGRAM].tail, by[NGRAM].tokens_per_s) == (pytest.approx(0.6), pytest.approx(1200))
    assert (by[PLAIN].tail, by[PLAIN].tokens_per_s) == (pytest.approx(1.0), pytest.approx(808))
    assert by[VEGAS].tokens_per_iteration == 5 and by[VEGAS].iteration_s == pytest.approx(8 * 5 / 1600 * 0.6)
    assert tables.lookup(t, 8, "sample", 12000, new_tokens=256)[1][0].tokens_per_s == pytest.approx(1600)
    # a cell measured over another run length is another cell: the run takes the nearest length by
    # ratio (without one, the shortest), and scales its tails from there
    longer = [entry(PLAIN, 800, 1, 8), entry(VEGAS, 1500, 5, 8), entry(SHARED, 1700, 9, 8)]
    tables.set_cell(t, 8, "greedy", 8192, "strict", longer, new_tokens=1024)
    assert len(t["cells"]) == 5 and t["cells"][3]["new_tokens"] == 256
    firsts = {n: tables.lookup(t, 8, "sample", 12000, new_tokens=n)[1][0].strategy for n in (256, 500, 600, 4096, None)}
    assert firsts == {256: VEGAS, 500: VEGAS, 600: SHARED, 4096: SHARED, None: VEGAS}
    assert tables.lookup(t, 8, "sample", 12000, new_tokens=1024)[1][0].tokens_per_s == pytest.approx(1700)
    tables.set_cell(t, 8, "greedy", 8192, "strict", longer[:2], new_tokens=1024)  # the same length: replaced
    assert len(t["cells"]) == 5 and len(t["cells"][-1]["ranked"]) == 2
    # a prediction's weight is the iterations its cell measured: the cell's own new tokens, else the header's
    t["cells"][0]["new_tokens"] = 256
    assert tables.lookup(t, 1, "greedy", 900)[1][0].iterations == 3 * 256
    assert tables.lookup(t, 1, "greedy", 8000)[1][0].iterations == 3 * 8


def test_bandwidth_is_timed_over_back_to_back_calls(monkeypatch):
    """The cost model's bandwidth: calls chained with one host sync a timed run (one call timed with
    its sync read half the H100's bandwidth), positive and finite."""
    calls, syncs, real = [], [], jax.block_until_ready
    f = jax.jit(lambda x: x + 1)
    monkeypatch.setattr(jax, "block_until_ready", lambda x: syncs.append(1) or real(x))
    seconds = cost.seconds_per_call(lambda x: calls.append(1) or f(x), jnp.ones((1 << 16,)), min_run_s=0.2)
    assert seconds > 0 and len(syncs) == 5 and len(calls) > 2 * len(syncs)  # warm-up, a probe, 3 timed runs
    monkeypatch.undo()
    cost.measure_bandwidth.cache_clear()
    assert 0 < cost.measure_bandwidth() < float("inf")


def test_auto_picks_plain_when_the_table_ranks_it_first(tmp_path):
    path = tmp_path / "t.json"
    tables.save_table(path, table())
    plan = planner.make_plan(SMOLLM2, 270_000_000, batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(),
                             table=path)
    assert plan.first == PLAIN and plan.source == f"table:{path}" and plan.bucket == 1024
    # a speculative strategy within MARGIN of plain is not worth it either
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), entry(VEGAS, 950, 5)])]))
    assert planner.make_plan(SMOLLM2, 1, batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(), table=path).first == PLAIN
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), entry(VEGAS, 1200, 5)])]))
    assert planner.make_plan(SMOLLM2, 1, batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(), table=path).first == VEGAS
    with pytest.raises(JaxspecError, match="is for model"):
        planner.make_plan(QWEN3_8B, 1, batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(), table=path)
    # the best chain ngram entry is kept (for replays) beyond the CANDIDATES best; an ngram tree is not
    faster = [entry(Strategy("vegas", gamma=g, ratio=0.07), 1300 + g, 5) for g in (2, 3, 4, 5)]
    ngram_tree = Strategy("ngram", tree=(2, 1))
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), *faster, entry(ngram_tree, 1000, 2),
                                                                         entry(NGRAM, 950, 2)])]))
    kept = [c.strategy for c in planner.make_plan(SMOLLM2, 1, batch=1, prompt_tokens=40, new_tokens=256,
                                                  sampling=SamplingConfig(), table=path).candidates]
    assert [s.gamma for s in kept if s.method == "vegas"] == [5, 4, 3] and NGRAM in kept and ngram_tree not in kept
    # a static batch waits for its slowest row, a server admitting into freed rows does not: ngram
    # at half its mean rate in the cell is second there and first at its mean rate
    tail = entry(NGRAM, 1100, 2, batch=4)
    tail["iteration_s"] *= 0.5
    tables.save_table(path, table(cells=[(4, "sample", 8192, "strict", [entry(PLAIN, 900, 1, 4), entry(VEGAS, 1400, 5, 4), tail])]))
    run = dict(batch=4, prompt_tokens=6000, new_tokens=1024, sampling=SamplingConfig(temperature=1.0), table=path)
    assert planner.make_plan(SMOLLM2, 1, **run).first == VEGAS
    plan = planner.make_plan(SMOLLM2, 1, closed=False, **run)
    assert plan.first == NGRAM and plan.candidates[0].tokens_per_s == pytest.approx(2200) and plan.candidates[0].tail == 1.0


def test_ngram_entries_need_a_prompt_like_the_cells(tmp_path):
    """ngram's measured rate comes from copying the calibration prompts: a run with a short prompt
    plans without it (the model drafter is chosen), one with a comparable prompt keeps it."""
    path = tmp_path / "t.json"
    t = table(cells=[])
    tables.set_cell(t, 1, "greedy", 1024, "strict", [entry(PLAIN, 500, 1), entry(NGRAM, 1400, 2.3), entry(FULL_INT8, 850, 7)],
                    prompt_tokens=960)
    tables.save_table(path, t)
    run = dict(batch=1, new_tokens=64, sampling=SamplingConfig(), table=path)
    short = planner.make_plan(SMOLLM2, 1, prompt_tokens=47, **run)
    assert short.first == FULL_INT8 and NGRAM not in {c.strategy for c in short.candidates}
    assert planner.make_plan(SMOLLM2, 1, prompt_tokens=900, **run).first == NGRAM
    assert planner.make_plan(SMOLLM2, 1, prompt_tokens=240, **run).first == NGRAM  # a quarter of 960: kept


def test_request_cells_answer_runs_with_short_prompts(tmp_path):
    """Cells profiled on short chat requests (`jaxspec.profile --prompts requests`) are their own:
    they do not replace the document cells of the same bucket, a run with a short prompt plans from
    them (eagle kept: the cell's prompts are as short as the run's), and a run with a document-sized
    prompt plans from the document cells, in whatever bucket those are."""
    eagle = Strategy("eagle", tree=(2, 1), traversal="bfs")
    path = tmp_path / "t.json"
    t = table(cells=[])
    t["cells"].clear()
    tables.set_cell(t, 1, "greedy", 2048, "strict", [entry(PLAIN, 900, 1), entry(NGRAM, 2000, 2.5),
                                                     {**entry(eagle, 1500, 2.4), "head": "h1"}], prompt_tokens=1005)
    tables.set_cell(t, 1, "greedy", 1024, "strict", [entry(PLAIN, 950, 1), {**entry(eagle, 1100, 1.6), "head": "h1"},
                                                     entry(NGRAM, 700, 1.1)], prompt_tokens=45, prompts="requests")
    tables.set_cell(t, 1, "greedy", 2048, "strict", [entry(PLAIN, 940, 1), entry(VEGAS, 990, 2)], prompt_tokens=50,
                    prompts="requests")
    tables.save_table(path, t)
    assert len(t["cells"]) == 3 and [tables.prompt_kind(c) for c in t["cells"]] == ["documents", "requests", "requests"]
    run = dict(batch=1, new_tokens=256, sampling=SamplingConfig(), table=path, head=SMOLLM2_HEAD, head_id="h1")
    chat = planner.make_plan(SMOLLM2, 270_000_000, prompt_tokens=47, **run)
    assert chat.bucket == 1024 and chat.first == eagle and NGRAM in {c.strategy for c in chat.candidates}
    assert chat.candidates[0].tokens_per_s == pytest.approx(1100, rel=0.2)  # the request cell's rate (run tail aside)
    document = planner.make_plan(SMOLLM2, 270_000_000, prompt_tokens=600, **run)
    assert document.bucket == 2048 and document.first == NGRAM  # the document cell, not the nearer request bucket
    # without a request cell the short run falls back to the document cell, less eagle and ngram
    t["cells"] = t["cells"][:1]
    tables.save_table(path, t)
    assert planner.make_plan(SMOLLM2, 270_000_000, prompt_tokens=47, **run).first == PLAIN


def test_eagle_is_planned_for_its_head_and_only_as_the_first_choice(tmp_path, monkeypatch):
    """A table's eagle entries answer only for runs with the head they measured and a prompt like the
    cell's; without a table the cost model predicts eagle; the best eagle strategy is a candidate only
    as the first choice (a run cannot switch into eagle), and the refinement never switches into it
    nor leaves it to probe plain."""
    head = SMOLLM2_HEAD
    monkeypatch.setattr(planner.plan, "measure_bandwidth", lambda: 4000.0)
    eagle3, eagle5 = Strategy("eagle", gamma=3), Strategy("eagle", gamma=5)
    measured = lambda s, rate, tpi, h="h1": {**entry(s, rate, tpi), "head": h}
    path = tmp_path / "t.json"
    t = table(cells=[])
    tables.set_cell(t, 1, "greedy", 1024, "strict", [
        entry(PLAIN, 900, 1), measured(eagle5, 2000, 3.5), measured(eagle3, 1900, 2.8), measured(eagle3, 5000, 3, "h2"),
        entry(VEGAS, 1000, 4), entry(NGRAM, 1200, 2)], prompt_tokens=800)
    tables.save_table(path, t)
    run = dict(batch=1, prompt_tokens=400, new_tokens=256, sampling=SamplingConfig(), table=path)
    assert eagle3 in [p.strategy for p in tables.lookup(tables.load_table(path), 1, "greedy", 600, head="h1")[1]]
    assert not any(p.strategy.method == "eagle" for p in tables.lookup(tables.load_table(path), 1, "greedy", 600)[1])
    plan = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h1", **run)
    assert plan.first == eagle5 and [c.strategy for c in plan.candidates] == [eagle5, NGRAM, VEGAS, PLAIN]
    assert plan.candidates[0].tokens_per_s == 2000 and plan.source == f"table:{path}"
    assert all(c.strategy.method != "eagle" for c in planner.make_plan(SMOLLM2, 1, **run).candidates)  # no head
    other = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h3", **run)  # another head's entries only
    assert other.first == NGRAM and other.unmeasured_head
    assert not planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h1", **run).unmeasured_head
    # a head measured in one cell only: a run that another cell answers, one ranking another head, is unmeasured
    cells = tmp_path / "cells.json"
    tables.set_cell(t, 1, "greedy", 8192, "strict", [entry(PLAIN, 800, 1), measured(eagle3, 3000, 3, "h2")],
                    prompt_tokens=7000)
    tables.set_cell(t, 1, "greedy", 2048, "strict", [entry(PLAIN, 850, 1), entry(NGRAM, 1500, 2)], prompt_tokens=1800)
    tables.save_table(cells, t)
    at = lambda prompt_tokens, head_id: planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id=head_id,
                                                         **{**run, "table": cells, "prompt_tokens": prompt_tokens})
    assert at(7000, "h1").unmeasured_head and not at(7000, "h2").unmeasured_head
    assert at(1700, "h3").first == NGRAM and not at(1700, "h3").unmeasured_head  # no head measured there
    short = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h1", **{**run, "prompt_tokens": 150})
    assert short.first == VEGAS  # under a quarter of the cell's prompt: neither eagle's nor ngram's entries
    # without a table: the cost model's eagle (gamma 3 and 5), a candidate only as the first choice
    assert {p.strategy for p in cost.cost_model(SMOLLM2, 270_000_000, 1, 528, 4000.0, 256, head)} >= {eagle3, eagle5}
    assert not {eagle3, eagle5} & {p.strategy for p in cost.cost_model(SMOLLM2, 270_000_000, 1, 528, 4000.0, 256)}
    plan = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h3", **{**run, "table": None})
    assert plan.source == "cost-model" and all(c.strategy.method != "eagle" or c.strategy == plan.first
                                               for c in plan.candidates)
    # eagle measured below vegas: vegas first, and eagle not among the candidates
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [
        entry(PLAIN, 900, 1), measured(eagle5, 1100, 3.5), entry(VEGAS, 2000, 4)])]))
    plan = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h1", **run)
    assert plan.first == VEGAS and [c.strategy for c in plan.candidates] == [VEGAS, PLAIN]
    # eagle second of four speculative strategies: its place among the CANDIDATES goes to the fourth
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [
        entry(PLAIN, 900, 1), entry(VEGAS, 2000, 4), measured(eagle5, 1900, 3.5), entry(SPACED, 1800, 4),
        entry(TREE, 1700, 3)])]))
    plan = planner.make_plan(SMOLLM2, 270_000_000, head=head, head_id="h1", **run)
    assert plan.first == VEGAS and [c.strategy for c in plan.candidates] == [VEGAS, SPACED, TREE, PLAIN]
    # the refinement: eagle is left for a faster candidate, never probes plain, is never switched into
    candidates = (Prediction(eagle5, 2000, 3.5, 3.5 / 2000), Prediction(PLAIN, 900, 1.0, 1 / 900),
                  Prediction(VEGAS, 1000, 4.0, 4.0 / 1000))
    seen = lambda tokens, iteration_s: Observation(iterations=8, tokens=tokens, seconds=8 * iteration_s,
                                                   tokens_per_iteration=tokens / 8)
    target, reason = refine.decide(candidates, {VEGAS: seen(32, 0.004)}, VEGAS)  # 1000 tok/s
    assert target == PLAIN and "measuring plain" in reason  # vegas probes plain
    assert refine.decide(candidates, {eagle5: seen(14, 3.5 / 2000)}, eagle5)[0] == eagle5  # eagle does not
    assert refine.decide(candidates, {eagle5: seen(8, 3.5 / 2000)}, eagle5)[0] == VEGAS  # 571 tok/s: left for a faster one
    ran = {eagle5: seen(28, 3.5 / 2000), PLAIN: seen(8, 1 / 500)}
    assert refine.decide(candidates, ran, PLAIN)[0] == VEGAS  # not eagle, observed at 2000 tok/s


def test_shipped_tables_are_found(smollm2_gguf):
    """A shipped table is named by its model's fingerprint, and the shipped SmolLM2's (read from its
    GGUF, as generate does) finds its table: a config change that moves the fingerprint fails here
    rather than silently sending --method auto to the cost model."""
    from jaxspec.loaders import gguf

    reader = gguf._open(smollm2_gguf)
    cfg = gguf.read_config(gguf.read_metadata(reader), {t.name for t in reader.tensors}, "bfloat16")
    shipped = sorted(tables.TABLES.glob("*.json"))
    assert shipped
    for path in shipped:
        t = tables.load_table(path)
        assert path.name.startswith(t["model"]["fingerprint"] + "_"), path.name
    assert tables.table_path(cfg, "NVIDIA H100 80GB HBM3").is_file()
    assert tables.fingerprint(cfg.replace(tp=2)) != tables.fingerprint(cfg)


def test_default_request_plans_the_shipped_head_on_every_shipped_table(smollm2_gguf):
    """Generate's default request (one row, 47 prompt tokens, 256 new) plans eagle with the shipped
    head on every shipped SmolLM2 table, greedy and sampled: a head shipped before a table holds its
    entries would plan plain there, since a table's eagle entries count only for the head they measured."""
    from jaxspec.loaders import gguf
    from jaxspec.loaders.eagle import head_fingerprint, shipped_head

    reader = gguf._open(smollm2_gguf)
    cfg = gguf.read_config(gguf.read_metadata(reader), {t.name for t in reader.tensors}, "bfloat16")
    head_id = head_fingerprint(shipped_head("smollm2"))
    paths = sorted(tables.TABLES.glob(tables.fingerprint(cfg) + "_*.json"))
    assert len(paths) >= 2
    for path in paths:
        for sampling in (SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.95)):
            plan = planner.make_plan(cfg, 1, batch=1, prompt_tokens=47, new_tokens=256, sampling=sampling,
                                     table=path, head_id=head_id)
            assert plan.first.method == "eagle" and not plan.unmeasured_head, (path.name, sampling, plan.first)


def test_non_strict_classes_only_when_allowed(tmp_path):
    nsa = SMOLLM2.replace(model_type="llama-nsa", nsa=NSAConfig(block_size=16, block_counts=16, window_size=128))
    path = tmp_path / "t.json"
    tables.save_table(path, table(nsa, cells=[(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), entry(VEGAS, 950, 5)]),
                                              (1, "greedy", 1024, "approx", [entry(Strategy(precision="approx"), 900, 1),
                                                                             entry(APPROX, 3000, 5)])]))
    run = dict(batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(), table=path)
    strict = planner.make_plan(nsa, 1, **run)
    assert strict.first == PLAIN and all(c.strategy.precision == "strict" for c in strict.candidates)
    assert planner.make_plan(nsa, 1, precisions=planner.allowed_precisions("reuse"), **run).first == PLAIN
    assert planner.make_plan(nsa, 1, precisions=planner.allowed_precisions("approx"), **run).first == APPROX
    assert planner.allowed_precisions("strict") == ("strict",)
    assert planner.allowed_precisions("approx+reuse") == ("strict", "reuse", "approx", "approx+reuse")


def test_cost_model_int8_drafts_read_fewer_bytes():
    """At Qwen3-8B 1 x 4K the weights dominate a draft forward: int8 copies halve the layer matrices'
    bytes, so the int8 chain is predicted faster than the exact one at the same acceptance, and the
    plan asks for int8 copies only where they pay; full drafts read the whole context, so at 64K
    vegas int8 beats them."""
    weights = 16_400_000_000
    short = {p.strategy: p for p in cost.cost_model(QWEN3_8B, weights, batch=1, context=4096, bandwidth_GBps=3000)}
    vegas, vegas_int8 = VEGAS, dataclasses.replace(VEGAS, draft_weights="int8")
    assert short[vegas_int8].tokens_per_iteration == short[vegas].tokens_per_iteration
    assert short[vegas_int8].iteration_s < 0.8 * short[vegas].iteration_s
    long = cost.cost_model(QWEN3_8B, weights, batch=1, context=65536, bandwidth_GBps=3000)
    by = {p.strategy: p for p in long}
    assert by[vegas_int8].tokens_per_s > by[FULL_INT8].tokens_per_s
    # copies cost memory: kept where an int8 strategy beats plain (64K), dropped where none does (4K)
    assert by[vegas_int8].tokens_per_s > by[PLAIN].tokens_per_s and paid_copies(long) == long
    kept = paid_copies(list(short.values()))
    assert short[vegas_int8].tokens_per_s < short[PLAIN].tokens_per_s
    assert {p.strategy.draft_weights for p in kept} == {"exact"} and len(kept) == len(short) - 2
    assert vegas_int8 in [p.strategy for p in long[:3]]
    assert planner.Plan(tuple(long[:3]) + (by[PLAIN],), long[0].strategy, "cost-model", 65536).draft_weights == "int8"
    assert planner.Plan(tuple(kept), kept[0].strategy, "cost-model", 4096).draft_weights == "exact"
    int4 = Prediction(dataclasses.replace(VEGAS, draft_weights="int4"), 1.0, 2.0, 1.0)
    with pytest.raises(JaxspecError, match="one kind of copies"):
        _ = planner.Plan((by[vegas_int8], int4, by[PLAIN]), PLAIN, "cost-model", 65536).draft_weights
    # past one row block of the kernel every block reads the int8 matrix again: no int8 candidates
    assert {p.strategy.draft_weights for p in cost.cost_model(QWEN3_8B, weights, batch=128, context=4096,
                                                              bandwidth_GBps=3000)} == {"exact"}
    int8_bytes = draft_weights.read_bytes(QWEN3_8B, weights, "int8")
    matrices = sum(np.prod(decoder.param_shapes(QWEN3_8B)["layers"][n]) for n in draft_weights.DRAFT_MATRICES)
    head = QWEN3_8B.vocab_size * QWEN3_8B.hidden_size
    assert weights - int8_bytes == pytest.approx(matrices + head, rel=0.01)  # bf16 -> int8: a byte per element saved


def test_cost_model_plain_when_weights_dominate_sparse_when_kv_does():
    """SmolLM2 at batch 1 and a short context: every forward costs its launch overhead and reads the
    weights, so drafting only adds forwards; Qwen3-8B at 8 x 32K reads 2.4x its weights in KV per
    step, which a 7% draft skips."""
    small = cost.cost_model(SMOLLM2, 270_000_000, batch=1, context=300, bandwidth_GBps=3000)
    assert small[0].strategy.kind != "model" and choose(small).kind != "model"
    by = {p.strategy: p for p in small}
    assert by[PLAIN].tokens_per_s > by[Strategy("vegas", gamma=2, ratio=0.07)].tokens_per_s
    large = cost.cost_model(QWEN3_8B, 16_400_000_000, batch=8, context=32768, bandwidth_GBps=3000)
    by = {p.strategy: p for p in large}
    vegas = max((p for p in large if p.strategy.method == "vegas"), key=lambda p: p.tokens_per_s)
    assert vegas.tokens_per_s > 1.2 * by[PLAIN].tokens_per_s
    # the floor: plain's step is the bytes floor plus 36 layers of launch overhead
    floor = cost.step_floor_s(QWEN3_8B, 16_400_000_000, 8, 32768, 3000)
    assert by[PLAIN].iteration_s == pytest.approx(floor + 36 * cost.LAYER_OVERHEAD_S)
    no_ngram = [p for p in large if p.strategy.method != "ngram"]
    assert choose(no_ngram).method == "vegas"


def test_cost_model_closed_batches_wait_for_ngram_and_eagle_slowest_rows():
    """A static batch of 128 rows lasts as long as its slowest row, which ngram and the draft head
    leave far behind their mean row (the head's measured tail at 128 rows: 0.5): their predictions
    keep that share, plain's and vegas' do not change, and at 128 x 1.3K plain is chosen (ngram's
    probe there ran 0.95x plain on the GPU). One row, or an open batch, has no tail."""
    head = SMOLLM2_HEAD
    open_, closed = ({p.strategy: p for p in cost.cost_model(SMOLLM2, 270_000_000, 128, 1280, 4200.0, 256, head, c)}
                     for c in (False, True))
    for strategy, p in closed.items():
        want = 0.5 if strategy.kind in ("ngram", "eagle") else 1.0
        assert p.tail == pytest.approx(want) and p.tokens_per_s == pytest.approx(want * open_[strategy].tokens_per_s)
    assert choose(list(open_.values())).kind == "ngram" and choose(list(closed.values())).plain
    assert all(p.tail == 1.0 for p in cost.cost_model(SMOLLM2, 270_000_000, 1, 1280, 4200.0, 256, head, True))


def test_cost_model_reads_a_windowed_heads_kv_within_its_window():
    windowed = dataclasses.replace(SMOLLM2_HEAD, sliding_window=2048)
    step = lambda head, context: cost.head_step_bytes(head, SMOLLM2, 4, context)
    assert step(windowed, 8000) == step(SMOLLM2_HEAD, 2048) < step(SMOLLM2_HEAD, 8000)
    assert step(windowed, 1000) == step(SMOLLM2_HEAD, 1000)


def test_cost_model_reads_a_shared_lm_head_from_the_target():
    """A head through the target's LM head reads the target's matrix instead of its own, and forms
    logits over the whole vocabulary (4 rows of float32)."""
    shared = dataclasses.replace(SMOLLM2_HEAD, shared_lm_head=True, draft_vocab_size=SMOLLM2.vocab_size)
    step = lambda head: cost.head_step_bytes(head, SMOLLM2, 4, 1000)
    V, Vd, H, itemsize = SMOLLM2.vocab_size, SMOLLM2_HEAD.draft_vocab_size, SMOLLM2.hidden_size, 2
    assert SMOLLM2.dtype == "bfloat16"
    assert step(shared) - step(SMOLLM2_HEAD) == (V - Vd) * H * itemsize + 4 * (V - Vd) * 4


def test_cost_model_moe_rows_read_the_experts_they_hit():
    """At Qwen3-30B-A3B's shapes one token reads 8 of each layer's 128 experts, a verify pass of 7
    rows the expected distinct ones (~47), so its floor is dearer than a plain step's by those
    experts' bytes; a dense model reads all its weights at any row count. Packed MXFP4 experts (4.25
    bits a weight) are priced as stored: the experts' share of the weights, whatever its format."""
    moe = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                      num_kv_heads=4, head_dim=128, intermediate_size=6144, qk_norm=True,
                      moe=MoEConfig(num_experts=128, top_k=8, expert_size=768, norm_topk_prob=True))
    expert = 3 * 2048 * 768 * 2
    shapes = decoder.param_shapes(moe)
    rest = 2 * sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))) - 48 * 128 * expert
    total = rest + 48 * 128 * expert
    assert cost.weight_bytes_read(moe, total, 1) == rest + 48 * 8 * expert
    hit = 128 * (1 - (120 / 128) ** 7)
    assert 44 < hit < 50 and cost.weight_bytes_read(moe, total, 7) == pytest.approx(rest + 48 * hit * expert, abs=1)
    assert cost.weight_bytes_read(moe, total, 10_000) == pytest.approx(total)
    assert cost.weight_bytes_read(QWEN3_8B, 16_400_000_000, 7) == 16_400_000_000
    plain, verify = (cost.step_floor_s(moe, total, 1, 4096, 4000, rows) for rows in (1, 7))
    assert verify - plain == pytest.approx(48 * (hit - 8) * expert / 4e12, rel=1e-6)
    packed = expert * 4.25 / 16
    assert cost.weight_bytes_read(moe, rest + 48 * 128 * packed, 1) == pytest.approx(rest + 48 * 8 * packed, abs=1)
    vegas = cost.predict(Strategy("vegas", gamma=6, ratio=0.07), moe, total, 1, 4096, 4000)
    dense_rows = cost.predict(Strategy("vegas", gamma=6, ratio=0.07), moe.replace(model_type="qwen3", moe=None),
                              total, 1, 4096, 4000)
    assert vegas.iteration_s < dense_rows.iteration_s  # fewer weight bytes than a dense model of that size


def test_refinement_switches_on_a_mismatch_and_not_on_a_match():
    candidates = (Prediction(VEGAS, 1200, 5.0, 5.0 / 1200), Prediction(PLAIN, 900, 1.0, 1 / 900),
                  Prediction(Strategy("stream", gamma=4, ratio=0.07), 1000, 4.0, 4.0 / 1000))
    match = {VEGAS: Observation(iterations=8, tokens=40, seconds=8 * 5.0 / 1200, tokens_per_iteration=5.0)}
    assert refine.decide(candidates, match, VEGAS)[0] == VEGAS
    # the same iteration time but 1.5 tokens per iteration instead of 5: the model drafters' acceptance
    # falls for stream too, and plain wins
    low = {VEGAS: Observation(iterations=8, tokens=12, seconds=8 * 5.0 / 1200, tokens_per_iteration=1.5)}
    expected = refine.corrected(candidates, low)
    assert expected[VEGAS] == pytest.approx(360)
    assert expected[Strategy("stream", gamma=4, ratio=0.07)] == pytest.approx(1000 * (1 + 0.5 / 4 * 3) / 4)
    target, reason = refine.decide(candidates, low, VEGAS)
    assert target == PLAIN and "plain predicted" in reason
    # twice slower steps than the table: every prediction slows down, so no switch on time alone
    slow = {VEGAS: Observation(iterations=8, tokens=40, seconds=2 * 8 * 5.0 / 1200, tokens_per_iteration=5.0)}
    assert refine.decide(candidates, slow, VEGAS)[0] == VEGAS
    # after plain was observed at its prediction, vegas (observed worse) is not tried again
    both = {**low, PLAIN: Observation(iterations=8, tokens=8, seconds=8 / 900, tokens_per_iteration=1.0)}
    assert refine.decide(candidates, both, PLAIN)[0] == PLAIN
    # vegas within 25% of plain's prediction: plain is measured, then kept unless vegas is 10% faster
    tie = {VEGAS: Observation(iterations=8, tokens=32, seconds=8 * 5.0 / 1200, tokens_per_iteration=4.0)}  # 960 tok/s
    target, reason = refine.decide(candidates, tie, VEGAS)
    assert target == PLAIN and "measuring plain" in reason
    tie[PLAIN] = Observation(iterations=8, tokens=8, seconds=8 / 900, tokens_per_iteration=1.0)
    assert refine.decide(candidates, tie, PLAIN)[0] == PLAIN
    tie[PLAIN] = Observation(iterations=8, tokens=8, seconds=8 / 800, tokens_per_iteration=1.0)
    assert refine.decide(candidates, tie, PLAIN)[0] == VEGAS
    # a table's plain rate is measured: table plans do not probe it unless it is predicted 10% faster
    del tie[PLAIN]
    assert refine.decide(candidates, tie, VEGAS, probe_margin=None)[0] == VEGAS
    assert refine.decide(candidates, low, VEGAS, probe_margin=None)[0] == PLAIN
    # vegas far above plain's corrected prediction: plain goes unmeasured, unless the margin is inf (a CPU)
    assert refine.decide(candidates, slow, VEGAS)[0] == VEGAS
    target, reason = refine.decide(candidates, slow, VEGAS, probe_margin=math.inf)
    assert target == PLAIN and "measuring plain" in reason


def test_plain_is_always_probed_on_a_cpu(tmp_path, monkeypatch):
    """The cost model counts bytes, which a CPU's verified rows do not: its plans measure plain
    whatever the margin there, an accelerator's unless the drafter beats plain by PROBE_MARGIN, and a
    table's never (its plain rate was measured on the device)."""
    monkeypatch.setattr(planner.plan, "measure_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(planner.plan, "table_path", lambda cfg, device: tmp_path / "none.json")  # no shipped table
    run = dict(batch=1, prompt_tokens=400, new_tokens=256, sampling=SamplingConfig())
    monkeypatch.setattr(planner.plan, "device_kind", lambda: "cpu")
    assert planner.make_plan(SMOLLM2, 270_000_000, **run).probe_margin == math.inf
    monkeypatch.setattr(planner.plan, "device_kind", lambda: "NVIDIA H200")
    assert planner.make_plan(SMOLLM2, 270_000_000, **run).probe_margin == planner.plan.PROBE_MARGIN
    path = tmp_path / "t.json"
    tables.save_table(path, table(cells=[(1, "greedy", 1024, "strict", [entry(PLAIN, 900, 1), entry(VEGAS, 2000, 4)])]))
    assert planner.make_plan(SMOLLM2, 270_000_000, table=path, **run).probe_margin is None


def test_refinement_pools_a_table_entry_with_what_it_observes():
    """A table's ngram entry counts as one more segment: one slow first segment (ngram at a third
    of its table rate; its acceptance drifts within a run) does not switch away from it, five
    segments that accept nothing do; the cost model's predictions carry no weight."""
    ngram = Strategy("ngram", gamma=6)
    candidates = (Prediction(ngram, 900, 3.6, 3.6 / 900, 600, iterations=40),
                  Prediction(PLAIN, 400, 1.0, 1 / 400, 5, iterations=144),
                  Prediction(VEGAS, 380, 5.0, 5.0 / 380, 50, iterations=29))
    step = 3.6 / 900
    slow = Observation(iterations=8, tokens=10, seconds=8 * step, tokens_per_iteration=1.25)  # 312 tok/s
    expected = refine.corrected(candidates, {ngram: slow})
    assert expected[ngram] == pytest.approx((8 * 900 + 8 * 312.5) / 16)
    assert refine.decide(candidates, {ngram: slow}, ngram, probe_margin=None)[0] == ngram
    nothing = lambda n: Observation(iterations=8 * n, tokens=8 * n, seconds=8 * n * step, tokens_per_iteration=1.0)
    for n, rate in ((2, 467), (4, 380)):    # plain (400) not 10% faster
        assert refine.corrected(candidates, {ngram: nothing(n)})[ngram] == pytest.approx(rate, abs=0.5)
        assert refine.decide(candidates, {ngram: nothing(n)}, ngram, probe_margin=None)[0] == ngram
    assert refine.decide(candidates, {ngram: nothing(5)}, ngram, probe_margin=None)[0] == PLAIN  # 358 tok/s
    bare = tuple(dataclasses.replace(c, iterations=0.0) for c in candidates)
    assert refine.corrected(bare, {ngram: slow})[ngram] == pytest.approx(312.5)
    assert refine.decide(bare, {ngram: slow}, ngram, probe_margin=None)[0] == PLAIN


def test_observation_reports_the_slowest_running_row():
    """A segment's slowest row is the one that accepted least among the rows that ran all of it (a
    row that finished inside the segment is not slower for it, nor is one whose last tokens its limit
    cut); merging weighs segments by iterations and skips those without the figure."""
    from jaxspec.decoding.engine import SpecStats

    start = np.array([17, 30, 9, 41])
    ran = np.array([8, 8, 3, 8])  # row 2 finished after 3 of the segment's 8 iterations
    accepted = np.array([32, 4, 2, 30])
    gained = accepted + ran
    gained[3] -= 30  # row 3 reached its limit in the last iteration: its length was cut, not its drafts
    before = (start, SpecStats(np.full(4, 2), np.zeros(4, int), np.full(4, 5), np.zeros((4, 6), int)))
    after = (start + gained, SpecStats(2 + ran, np.zeros(4, int), 5 + accepted, np.zeros((4, 6), int)))
    seen = Observation.between(before, after, seconds=0.5)
    assert (seen.iterations, seen.tokens, seen.slowest_tokens_per_iteration) == (8, int(gained.sum()), 12 / 8)
    assert seen.tokens_per_iteration == pytest.approx((68 + 27) / 27)
    merged = seen.merge(Observation(iterations=24, tokens=96, seconds=1.0, tokens_per_iteration=2.0,
                                    slowest_tokens_per_iteration=1.0))
    assert merged.slowest_tokens_per_iteration == pytest.approx((1.5 * 8 + 1.0 * 24) / 32)
    assert merged.tokens_per_iteration == pytest.approx((95 / 27 * 8 + 2.0 * 24) / 32)
    assert seen.merge(Observation(iterations=4, tokens=4, seconds=0.1, tokens_per_iteration=1.0)).slowest_tokens_per_iteration == 1.5


def test_watch_replays_ngram_and_switches_when_the_text_starts_to_repeat():
    """Settled on vegas, the refinement watches ngram through replays of each window: a window whose
    text ngram would copy 5 tokens an iteration switches to it (a closed batch only if its slowest row
    copies too; not with fewer than WATCH tokens left); once running, ngram is judged by its latest
    window, and one that copies nothing switches back to vegas."""
    ngram = Strategy("ngram", gamma=6)
    candidates = (Prediction(VEGAS, 1200, 5.0, 8 * 5.0 / 1200, 50, iterations=29),
                  Prediction(PLAIN, 900, 1.0, 8 / 900, 5, iterations=144),
                  Prediction(ngram, 800, 2.0, 8 * 2.0 / 800, 100, iterations=40))
    plan = planner.Plan(candidates, VEGAS, "table:t.json", 8192)
    window = lambda tpi, slowest=None, n=64, step=8 * 5.0 / 1200: Observation(n, round(8 * n * tpi), n * step, tpi, slowest)
    looping = Observation.replayed(np.array([60, 60, 58, 0]), np.array([12, 12, 12, 0]), np.array([True, True, True, False]))
    assert (looping.tokens_per_iteration, looping.slowest_tokens_per_iteration) == (178 / 36, 58 / 12)
    for closed, slowest_row_copies in ((False, False), (True, True), (True, False)):
        r = planner.Refinement.of(plan, closed=closed)
        assert r.observe(window(5.0, n=8), finished=False, replays={ngram: window(1.5, n=8, step=0)}) is None
        assert not r.active and r.watching and r.replayed == (ngram,)
        replay = looping if slowest_row_copies else dataclasses.replace(looping, slowest_tokens_per_iteration=1.0)
        # too few tokens left for a switch to pay: none is made
        assert r.watch(window(5.0, 4.6), finished=False, replays={ngram: replay}, left=refine.WATCH - 1) is None
        switched = r.watch(window(5.0, 4.6), finished=False, replays={ngram: replay}, left=refine.WATCH)
        if closed and not slowest_row_copies:
            assert switched is None and r.current == VEGAS
            continue
        assert switched == ngram and "replayed" in r.switches[-1]["reason"]
        judged = replay.slowest_tokens_per_iteration if closed else replay.tokens_per_iteration
        assert r.watching and r.replayed == () and r.segments[-1]["replayed_tokens_per_iteration"] == {ngram.name: judged}
        # ngram's own window at 4.9 tokens an iteration: it stays (the next window twice as long);
        # copying nothing: back to vegas (windows of WATCH again)
        assert r.window == refine.WATCH and r.watch(window(4.9, 4.8, step=8 * 2.0 / 800), finished=False) is None
        assert r.window == 2 * refine.WATCH
        assert r.watch(window(1.0, 1.0, step=8 * 2.0 / 800), finished=False) == VEGAS and r.window == refine.WATCH
    # the switch limit ends the watch
    r.switches += [{}] * (refine.MAX_SWITCHES - len(r.switches))
    assert not r.watching
    # a strategy observed and replayed: its observed rate (pooled with its table's) at the replay's
    # tokens per iteration
    seen = {ngram: Observation(64, 640, 64 * 0.02, 1.25)}  # 500 tok/s at 1.25 tokens an iteration
    expected = refine.corrected(candidates, seen, {ngram: Observation(0, 0, 0.0, 2.5)})[ngram]
    assert expected == pytest.approx((8 * 800 + 64 * 500) / 72 * 2.5 / 1.25)


def test_watch_thresholds_are_where_watch_switches():
    """A closed batch settled on plain watches on the device by thresholds: each replayed ngram
    strategy's is the least replayed tokens per iteration (its slowest row's) at which `decide`, as
    `watch` calls it now, switches to it; just below it stays; a candidate that cannot beat plain
    even copying its whole depth gets inf; an open batch, or a drafter the cost model planned, is watched on
    the host; a table's drafter in a closed batch on the device from its first iteration."""
    g8, g2 = Strategy("ngram", gamma=8), Strategy("ngram", gamma=2)
    candidates = (Prediction(PLAIN, 900, 1.0, 8 / 900, 5, iterations=144), Prediction(NGRAM, 800, 1.6, 8 * 1.6 / 800, 10),
                  Prediction(g8, 600, 1.8, 8 * 1.8 / 600, 20), Prediction(g2, 300, 1.5, 8 * 1.5 / 300, 10))
    r = planner.Refinement.of(planner.Plan(candidates, PLAIN, "table:t.json", 1024), closed=True)
    r.watched(Observation(64, 8 * 64, 64 * 8 / 950, 1.0, 1.0), refine.WATCH)  # plain observed at 950 tok/s
    assert r.watches_on_device and set(r.replayed) == {NGRAM, g8, g2}
    thresholds = r.thresholds(r.own_floor())
    assert thresholds[g2] == math.inf and 1 < thresholds[NGRAM] < 1 + NGRAM.depth and 1 < thresholds[g8] < 1 + g8.depth
    for strategy in (NGRAM, g8):
        for tpi, switches in ((thresholds[strategy], True), (thresholds[strategy] * (1 - 1e-4), False)):
            replays = {s: Observation(8, 8, 0.0, 1.0, 1.0) for s in r.replayed}  # judged: at the slowest row
            replays[strategy] = Observation(8, round(8 * tpi), 0.0, tpi, tpi)
            target, _ = refine.decide(candidates, r.observations, PLAIN, probe_margin=None, replays=replays, closed=True)
            assert (target == strategy) == switches, (strategy, tpi)
    assert not planner.Refinement.of(planner.Plan(candidates, PLAIN, "table:t.json", 1024), closed=False).watches_on_device
    assert not planner.Refinement.of(planner.Plan(candidates, VEGAS, "cost-model", 1024), closed=True).watches_on_device
    assert not planner.Refinement.of(planner.Plan(candidates, VEGAS, "table:t.json", 1024)).watches_on_device
    assert planner.Refinement.of(planner.Plan(candidates, VEGAS, "table:t.json", 1024), closed=True).watches_on_device


def test_plain_choice_starts_settled():
    """The cost model's plain choice starts settled, as a table's does: a segment of plain leaves
    `decide` on plain at whatever rate plain is observed (every prediction scales by one tau), so
    only a replay of ngram could move it, which the watch does (on the device, in a closed batch)."""
    candidates = (Prediction(PLAIN, 900, 1.0, 8 / 900), Prediction(VEGAS, 850, 2.0, 8 * 2.0 / 850),
                  Prediction(NGRAM, 800, 1.6, 8 * 1.6 / 800))
    plan = planner.Plan(candidates, PLAIN, "cost-model", 2048)
    r = planner.Refinement.of(plan, closed=True)
    assert not r.active and r.watching and r.watches_on_device
    for rate in (300.0, 900.0, 2700.0):  # plain observed a third, once, three times as fast as predicted
        seen = {PLAIN: Observation(8, 64, 64 / rate, 1.0, 1.0)}
        assert refine.decide(candidates, seen, PLAIN, probe_margin=refine.PROBE_MARGIN)[0] == PLAIN
        copying = {NGRAM: Observation(8, 8 * 4, 0.0, 4.0, 4.0)}
        assert refine.decide(candidates, seen, PLAIN, probe_margin=refine.PROBE_MARGIN, replays=copying)[0] == NGRAM
    assert planner.Refinement.of(planner.Plan(candidates, VEGAS, "cost-model", 2048), closed=True).active


def test_device_watch_crosses_where_the_host_replay_would(tiny):
    """`programs.watched` over one window decodes what plain decoding does and reports every token it
    committed, and its replay of ngram (the slowest whole row's tokens per iteration, its iterations as
    the host's replay counts them) crosses a threshold exactly where the host's `Observation.replayed`
    of the window it reports reaches it, if the window ends within `until`."""
    from jaxspec.decoding.drafters import make_drafter
    from jaxspec.runner import decode_fns, prefill_fn
    from jaxspec.serving import programs

    cfg, params, batch = tiny
    max_len, sampling, spec = 160, SamplingConfig(), SpecConfig()
    ids, lengths = jnp.asarray(batch.ids), jnp.asarray(batch.lengths)
    start, decode = decode_fns(cfg, spec, sampling, max_len)
    state = decode(params, start(params, prefill_fn(cfg, max_len, "reference", 256)(params, ids, lengths), ids, lengths,
                                 key=jax.random.key(0), budget=spec.budget(), max_new_tokens=jnp.int32(120),
                                 stop_ids=jnp.asarray([-1])), max_iterations=jnp.int32(24))
    reference = decode(params, jax.tree.map(jnp.copy, state), max_iterations=jnp.int32(40))
    watched = programs.watched(cfg, spec.compiled(max_len), sampling, max_len, (NGRAM.spec(spec),), max_len).jitted
    since = np.asarray(state.length)

    def run(threshold, until=40, own_floor=0.0):
        out, report, watch = watched(params, jax.tree.map(jnp.copy, state), np.int32(40), np.int32(0), np.int32(64),
                                     np.asarray([threshold], np.float32), np.float32(own_floor), np.int32(until), since)
        return out, programs.unpack_report(np.asarray(report)), programs.unpack_watch(np.asarray(watch))

    crossed = lambda *a, **k: run(*a, **k)[2][3]
    out, (reported, _, read, _), (length, ran, window, is_crossed, replays) = run(np.inf)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    assert not is_crossed and window == 128 and (np.asarray(length) == np.asarray(state.length)).all()
    # its report: every token the call committed, from `since`, as the report program reads them
    np.testing.assert_array_equal(reported, reference.length)
    for b, (begin, end) in enumerate(zip(since, np.asarray(reference.length))):
        np.testing.assert_array_equal(read[b, : end - begin], np.asarray(reference.tokens)[b, begin:end])
    iterations = np.asarray(out.stats.iterations) - np.asarray(ran)
    whole, end = iterations == iterations.max(), np.asarray(out.length)
    begin = np.where(whole, np.asarray(length), end)
    replayed = np.asarray(make_drafter(NGRAM.spec(spec), cfg, max_len).replay(out.tokens, begin, end))
    np.testing.assert_array_equal(replays, replayed[None])  # the host's replays need not run again
    slowest = Observation.replayed(end - begin, replayed, whole).slowest_tokens_per_iteration
    assert slowest > 1  # the text repeats: chains to find
    assert crossed(np.float32(slowest)) and not crossed(np.nextafter(np.float32(slowest), np.float32(np.inf)))
    assert not crossed(np.float32(slowest), until=39)  # a window ending past `until` is not judged
    # the running strategy's own tokens per iteration since the call's start, as the host counts them
    own = Observation.between((np.asarray(state.length), jax.device_get(state.stats)),
                              (end, jax.device_get(out.stats)), 1.0).tokens_per_iteration
    assert crossed(np.inf, own_floor=np.nextafter(np.float32(own), np.float32(np.inf)))
    assert not crossed(np.inf, own_floor=np.float32(own) * (1 - 1e-6))
    assert not crossed(np.inf, until=39, own_floor=np.inf)


def test_watch_leaves_a_model_drafter_that_does_badly_on_this_text():
    """Settled on a model drafter (here eagle, chosen from its table entry), the refinement keeps
    watching it with nothing to replay: all its windows pooled, which outweigh its table rate as they
    add up, so a drafter that accepts less on this run's text than on the table's is left for plain;
    one within MARGIN of plain stays. Plain running has nothing to watch."""
    eagle5 = Strategy("eagle", gamma=5)
    candidates = (Prediction(eagle5, 2000, 3.5, 3.5 / 2000, iterations=29), Prediction(PLAIN, 900, 1.0, 1 / 900, iterations=144))
    plan = planner.Plan(candidates, eagle5, "table:t.json", 8192)
    window = lambda n, tpi: Observation(n, round(n * tpi), n * 3.5 / 2000, tpi)  # the table's iteration time
    for tpi, left in ((1.0, True), (1.5, False)):  # 571 and 857 tok/s against plain's 900
        r = planner.Refinement.of(plan)
        assert r.observe(window(8, tpi), finished=False) is None  # one segment pooled with 2000: stays
        assert not r.active and r.watching and r.replayed == ()
        switched = r.watch(window(64, tpi), finished=False)
        if left:
            assert switched == PLAIN and r.switches[-1]["from"] == eagle5.name and not r.watching
            continue
        assert switched is None and r.window == 2 * refine.WATCH
        assert r.watch(window(128, tpi), finished=False) is None and r.watching
        assert r.observations[eagle5].iterations == 8 + 64 + 128  # pooled, not the latest window alone


def test_a_running_drafter_is_watched_on_the_device_down_to_its_floor():
    """Settled on an observed model drafter, a closed batch watches on the device: `own_floor` is the
    tokens per iteration under which a long stretch of the drafter makes `watch` leave it, just over
    which it stays; a call of one window over the floor never leaves it (the floor looks early, never
    late). The replays' thresholds are taken with the drafter at its floor: a replay there switches,
    and they are no higher than at the drafter's present rate. Plain's floor is 0; running ngram and
    a drafter not yet observed are watched on the host."""
    import copy

    eagle5, g8 = Strategy("eagle", gamma=5), Strategy("ngram", gamma=8)
    candidates = (Prediction(eagle5, 2000, 3.5, 3.5 / 2000, iterations=29),
                  Prediction(PLAIN, 900, 1.0, 1 / 900, iterations=144), Prediction(g8, 600, 1.8, 1.8 / 600, 20))
    plan = planner.Plan(candidates, eagle5, "cost-model", 8192)
    window = lambda n, tpi: Observation(n, n * tpi, n * 3.5 / 2000, tpi)  # one row at the table's iteration time
    r = planner.Refinement.of(plan, closed=True)
    assert not r.watches_on_device  # refining
    assert r.observe(window(8, 3.0), finished=False, replays={g8: Observation(8, 8, 0.0, 1.0, 1.0)}) is None
    assert r.watches_on_device
    floor = r.own_floor()
    assert 1 < floor < 2  # eagle at 571 tok/s a token an iteration against plain's 900
    ones = {g8: Observation(1, 1, 0.0, 1.0, 1.0)}
    for n, tpi, leaves in ((refine.STRETCH, floor * (1 - 1e-6), True), (refine.STRETCH, floor * (1 + 1e-6), False),
                           (refine.WATCH, floor * (1 + 1e-6), False)):
        watched = copy.deepcopy(r)
        assert (watched.watch(window(n, tpi), finished=False, replays=ones) == PLAIN) == leaves, (n, tpi)
    # the call looks midway between the floor and the drafter's rate, its thresholds taken there: higher
    level, rate = r.look_level(floor), r.observations[eagle5].tokens_per_iteration
    assert floor < level < rate and level == pytest.approx((floor + rate) / 2) and r.look_level(math.inf) == math.inf
    assert r.thresholds(level)[g8] > r.thresholds(floor)[g8]
    threshold = r.thresholds(floor)[g8]
    at_floor = r._after(floor)
    for tpi, switches in ((threshold, True), (threshold * (1 - 1e-4), False)):
        target, _ = refine.decide(candidates, at_floor, eagle5, probe_margin=None,
                                  replays={g8: Observation(8, 8 * tpi, 0.0, tpi, tpi)}, closed=True)
        assert (target == g8) == switches
    expected = refine.corrected(candidates, r.observations, ones, closed=True)
    assert threshold < expected[eagle5] * (1 + refine.MARGIN) / expected[g8]  # the host's bar now
    assert planner.Refinement.of(planner.Plan(candidates, PLAIN, "table:t.json", 8192), closed=True).own_floor() == 0
    assert not planner.Refinement(plan, eagle5, active=False, closed=True).watches_on_device  # not observed
    # a table's drafter starts watched on the device, its floor from the table's rate: the floor of a
    # refinement that observed that rate (one row at the table's iteration time and tokens an iteration)
    table = planner.Refinement.of(dataclasses.replace(plan, source="table:t.json"), closed=True)
    assert not table.active and table.watches_on_device and not table.observations
    observed = planner.Refinement.of(plan, closed=True)
    assert observed.observe(window(8, 3.5), finished=False, replays={g8: Observation(8, 8, 0.0, 1.0, 1.0)}) is None
    assert table.own_floor() == pytest.approx(observed.own_floor(), rel=1e-4) and 1 < table.own_floor() < 2
    running_ngram = planner.Refinement(plan, g8, active=False, closed=True, observations={g8: window(8, 2.0)})
    assert running_ngram.watching and not running_ngram.watches_on_device


def test_own_floor_is_where_decide_leaves_the_drafter():
    """`own_floor` (a secant search on `decide`'s margin) is where `decide`, after a long stretch of
    the running drafter, turns from leaving it to keeping it, to its precision, over random plans."""
    rng = np.random.default_rng()
    checked = 0
    for _ in range(60):
        eagle = Strategy("eagle", gamma=int(rng.integers(2, 7)))
        u = lambda a, b: float(rng.uniform(a, b))
        candidates = (Prediction(eagle, u(500, 3000), u(1.5, 4), u(5e-4, 2e-3), iterations=30, tail=u(0.8, 1)),
                      Prediction(PLAIN, u(500, 1500), 1.0, u(5e-4, 1e-3), iterations=100),
                      Prediction(VEGAS, u(300, 2000), u(1.5, 5), u(1e-3, 3e-3)),
                      Prediction(NGRAM, u(300, 1500), u(1, 2), u(5e-4, 1e-3), tail=0.5))
        r = planner.Refinement.of(planner.Plan(candidates, eagle, "table:t.json", 1024), closed=True)
        floor, ones = r.own_floor(), r._not_copying()
        if floor in (0.0, math.inf):
            continue
        keeps = lambda tpi: refine.decide(candidates, r._after(tpi), eagle, probe_margin=None, replays=ones,
                                          closed=True)[0] == eagle
        assert keeps(floor) and not keeps(floor - floor * refine.FLOOR_PRECISION * 2), floor
        checked += 1
    assert checked >= 10


def test_predictions_and_observations_meet_on_one_basis():
    """A table's tokens/s is a closed batch's, its slowest row included, while its tokens per
    iteration are its mean row's. ngram's table entry keeps half its mean rate (tail 0.5), vegas's
    0.8. Closed, ngram is judged by its slowest row: a replay whose slowest row copies as the table's
    closed tokens per iteration say predicts the table's rate, not half of it; vegas's mean-row
    window is scaled by its tail. Open (rows refill, no tail): mean rows against the rates without
    their tails."""
    ngram = Strategy("ngram", gamma=4)
    candidates = (Prediction(VEGAS, 1200, 5.0, 8 * 5.0 / 1200 * 0.8, tail=0.8),  # 8 rows: tail = rate x step / (rows x tpi)
                  Prediction(PLAIN, 900, 1.0, 8 / 900),
                  Prediction(ngram, 800, 2.0, 8 * 2.0 / 800 * 0.5, tail=0.5))
    at_table = Observation(8, 8 * 8 * 5, 8 * candidates[0].iteration_s, 5.0)  # vegas's mean rows as the table's
    assert at_table.tokens_per_s == pytest.approx(1500)
    for closed in (True, False):
        replay = Observation(0, 0, 0.0, 1.0 if closed else 2.0)  # as the table's rows did
        expected = refine.corrected(candidates, {VEGAS: at_table}, {ngram: replay}, closed)
        assert expected[VEGAS] == pytest.approx(1200 if closed else 1500)
        assert expected[ngram] == pytest.approx(800 if closed else 1600)
        assert expected[PLAIN] == pytest.approx(900)
    # ngram observed while running, closed: its slowest row at the table's closed rate, pooled with it
    seen = Observation(64, 64 * 8, 64 * candidates[2].iteration_s, 1.0)
    assert refine.corrected(candidates, {ngram: seen}, closed=True)[ngram] == pytest.approx(800)


def test_eagle_shapes_are_ranked_as_the_choice_ranks(tmp_path):
    """Of a head's shapes the plan keeps the one `choose` would rank first, by its pessimistic rate:
    the H200 table's sampled request cell at one row (round three's head), where 3,2,1 measured
    1,803 +- 313 tok/s and 3,2 1,715 +- 107, plans 3,2; with equal spreads, the higher median."""
    wide, narrow = Strategy("eagle", tree=(3, 2, 1), traversal="bfs"), Strategy("eagle", tree=(3, 2), traversal="bfs")
    spread = lambda e, x: {**e, "head": "h1", "spread_tokens_per_s": x}
    path = tmp_path / "t.json"
    run = dict(batch=1, prompt_tokens=40, new_tokens=256, sampling=SamplingConfig(temperature=0.7, top_p=0.95),
               table=path, head=SMOLLM2_HEAD, head_id="h1")
    for spreads, first in (((313, 107), narrow), ((107, 107), wide)):
        t = table(cells=[])
        entries = [entry(PLAIN, 1336, 1), spread(entry(wide, 1803, 1.98), spreads[0]),
                   spread(entry(narrow, 1715, 1.82), spreads[1])]
        tables.set_cell(t, 1, "sample", 1024, "strict", entries, prompt_tokens=40)
        tables.save_table(path, t)
        plan = planner.make_plan(SMOLLM2, 270_000_000, **run)
        assert plan.first == first and sum(c.strategy.method == "eagle" for c in plan.candidates) == 1


def test_choice_discounts_a_noisy_table_win():
    """A speculative entry whose median beats plain but whose spread reaches below plain + MARGIN is
    no win (the shipped SmolLM2 table's greedy 1K bucket: ngram 1,086 +- 562 vs plain 778)."""
    ngram = Strategy("ngram", tree=(3, 2, 1))
    noisy = (Prediction(ngram, 1086, 1.96, 1.8e-3, spread=562, runs=3), Prediction(PLAIN, 778, 1.0, 1.29e-3))
    assert choose(noisy) == PLAIN
    steady = (Prediction(ngram, 1010, 1.68, 1.68e-3, spread=83, runs=3), Prediction(PLAIN, 726, 1.0, 1.38e-3))
    assert choose(steady) == ngram


def test_more_runs_make_a_table_win_surer():
    """`pessimistic` holds the standard error of an entry's median against it: at 3 runs half their
    range, as before; two runs' range says less (a 1.2x win with a 200 tok/s range is no win), and 24
    runs' wider range says more (the same median with a 1,100 tok/s range is one, where half the range
    would have planned plain). Checked against draws: for normal runs, `median_error` of the mean range
    is the spread of the median, within 4% for odd runs, at most 15% over for even ones."""
    eagle, plain = Strategy("eagle", tree=(3, 2, 1), traversal="bfs"), Prediction(PLAIN, 1336, 1.0, 7.5e-4)
    win = lambda spread, runs: (Prediction(eagle, 1600, 2.0, 1.2e-3, spread=spread, runs=runs), plain)
    assert pessimistic(win(700, 3)[0]) == pytest.approx(1600 - 700 / 2, rel=2e-3)
    assert choose(win(700, 3)) == PLAIN and choose(win(1100, 24)) == eagle
    assert 1600 - 200 / 2 > 1.1 * 1336 and choose(win(200, 2)) == PLAIN
    draws = np.random.default_rng().normal(size=(20000, 24))
    for n in (2, 3, 5, 8, 24):
        x = draws[:, :n]
        ratio = median_error(float((x.max(1) - x.min(1)).mean()), n) / float(np.median(x, 1).std())
        assert 0.96 < ratio < (1.04 if n % 2 else 1.15)
    assert median_error(0.0, 1) == median_error(500.0, 1) == 0.0 and ERRORS > 1


@pytest.fixture(scope="module")
def tiny(hf_checkpoints):
    from jaxspec.loaders import load_model
    from jaxspec.runner import encode_prompts

    cfg, params, tokenizer = load_model(str(hf_checkpoints["llama"]), dtype="float32")
    batch = encode_prompts(tokenizer, ["The quick brown fox jumps", "def add(a, b): return a + b"], chat=False)
    return cfg, params, batch


def test_a_program_runs_before_only_when_it_compiles():
    """The scheduler's `before` waits for its queued work, so a compile never runs beside it (compiled
    beside it, that work's time would count as compiling, which a run's decode seconds leave out: a
    sampled 8-token default run on a CPU reported 0.005 s of decode for 0.28 s of work). A program
    compiled before does not wait."""
    program, x = programs.Program("double", jax.jit(lambda x: 2 * x)), jnp.arange(3.0)
    calls = []
    _, seconds = program.compile(x, before=lambda: calls.append("first"))
    _, again = program.compile(x, before=lambda: calls.append("again"))
    assert calls == ["first"] and seconds > 0 and again == 0


def empty_calls(monkeypatch, name: str) -> list[str]:
    """The schedulers' calls of program `name` with no iterations (the calls that load it), as they are made."""
    from jaxspec.serving.scheduler import Scheduler

    call, calls = Scheduler._call, []

    def counted(self, program, *args, **kw):
        if program.name == name and args[2] == 0:  # args: params, state, iterations, ...
            calls.append(name)
        return call(self, program, *args, **kw)

    monkeypatch.setattr(Scheduler, "_call", counted)
    return calls


def test_a_decode_programs_first_call_is_timed_apart(tiny, monkeypatch):
    """A run calls its decode program with no iterations first (LOAD_CALLS times), once a process (the
    calls that load it on the device), timed apart from decode (`Run.load_s`); a second run of the same
    shapes makes no such call, and both emit the same tokens."""
    cfg, params, batch = tiny
    common = dict(sampling=SamplingConfig(), max_len=64, max_new_tokens=12, stop_ids=(), spec=SpecConfig())
    empty = empty_calls(monkeypatch, "decode")
    programs.clear_executables()
    first = run_generation(params, cfg, batch, **common)
    again = run_generation(params, cfg, batch, **common)
    assert empty == ["decode"] * LOAD_CALLS and first.load_s > 0 and again.load_s == 0
    assert [g.tolist() for g in first.generated()] == [g.tolist() for g in again.generated()]
    assert summarize(first, batch, SpecConfig())["load_s"] == first.load_s


def test_switching_strategies_keeps_greedy_output(tiny, monkeypatch):
    """An auto run through vegas -> plain -> vegas selecting every 2nd verification -> ngram (decisions
    scripted) emits plain decoding's tokens, and its stats sum the four strategies' counters."""
    cfg, params, batch = tiny
    max_len, new = 320, 280  # three segments (8 iterations each) leave the rows running
    common = dict(sampling=SamplingConfig(), max_len=max_len, max_new_tokens=new, stop_ids=())
    reference = run_generation(params, cfg, batch, spec=SpecConfig(), **common)

    script = iter([(PLAIN, "scripted"), (SPACED, "scripted"), (NGRAM, "scripted")])
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: next(script))
    candidates = tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (VEGAS, PLAIN, SPACED, NGRAM))
    plan = planner.Plan(candidates, VEGAS, "test", 1024)
    run = run_generation(params, cfg, batch, plan=plan, spec=SpecConfig(), **common)
    assert [g.tolist() for g in run.generated()] == [g.tolist() for g in reference.generated()]
    assert [(s["from"], s["to"]) for s in run.auto.switches] == [
        ("vegas g6 r0.07", "plain"), ("plain", "vegas g6 r0.07 every 2"), ("vegas g6 r0.07 every 2", "ngram g4")]
    assert [s["iteration"] for s in run.auto.switches] == [8, 16, 24]
    stats = summarize(run, batch, run.auto.spec)
    assert (stats["method"], stats["method_requested"], stats["strategy"]["name"]) == ("ngram", "auto", "ngram g4")
    assert stats["planned"]["strategy"] == "vegas g6 r0.07" and len(stats["segments"]) == 4 and stats["lossless"]
    assert [s["strategy"] for s in stats["segments"]][2] == "vegas g6 r0.07 every 2"
    assert stats["segments"][1]["slowest_row_tokens_per_iteration"] == 1.0  # plain: a token a row iteration
    assert stats["generated_tokens"] == 2 * new
    assert len(stats["acceptance_by_depth"]) == 6  # padded to vegas' depth
    out = jax.device_get(run.output.stats)
    assert out.iterations.max() > 24 and (out.accepted <= out.drafted).all()
    # a plain choice (a table's or the cost model's) runs straight to the end, as plain decoding does:
    # no segments, no switch; with an ngram candidate it only watches it, on the device (a call to the
    # end, or to each window whose replay crosses its threshold, where the host decides: here never to
    # switch). The watching program's first call in the process, of no iterations, loads it; no later one.
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (current, "scripted"))
    loads = empty_calls(monkeypatch, "watched")
    programs.clear_executables()
    for plain_plan, watched in ((planner.Plan(candidates[:3], PLAIN, "table:t.json", 1024), False),
                                (planner.Plan(candidates, PLAIN, "table:t.json", 1024), True),
                                (planner.Plan(candidates, PLAIN, "cost-model", 1024), True)):
        run = run_generation(params, cfg, batch, plan=plain_plan, spec=SpecConfig(), **common)
        assert [g.tolist() for g in run.generated()] == [g.tolist() for g in reference.generated()]
        assert bool(run.auto.segments) == watched and all(s["watch"] for s in run.auto.segments)
        assert run.auto.switches == [] and sum(s["iterations"] for s in run.auto.segments) == (new - 1) * watched
    assert loads == ["watched"] * LOAD_CALLS


def test_watch_windows_on_the_device_and_ahead_of_the_host_stay_lossless(tiny, monkeypatch):
    """A closed batch settled on plain watches ngram on the device (`programs.watched`). With every
    threshold at one token an iteration, each window crosses: its call ends, and the host replays
    the window and decides (scripted here): windows of WATCH, then 2 WATCH iterations. It emits
    plain decoding's tokens, and no window's time holds the replays the host blocks on (1 s each
    here). Switched to ngram, the host watches, each window's next segment dispatched ahead of its
    report; a switch decided while a window runs ahead (ngram -> plain) hands out its tokens first,
    its stats reach the rows, and it is ngram's segment (the switch comes after it): AHEAD iterations,
    not a window. With `shrink` (6 of 8 rows end within 90 tokens) the batch shrinks to its 2 long rows."""
    import time

    from jaxspec.runner import Batch
    from jaxspec.serving.scheduler import Scheduler

    cfg, params, _ = tiny
    lengths = [40, 300, 290, 50, 280, 270, 250, 230]  # limits 280, 20, 30, 270, 40, 50, 70, 90
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, max(lengths))).astype(np.int32)
    batch = Batch(ids, np.asarray(lengths, np.int32))
    common = dict(sampling=SamplingConfig(), max_len=320, max_new_tokens=280, stop_ids=(), spec=SpecConfig(), shrink=True)
    reference = [g.tolist() for g in run_generation(params, cfg, batch, **{**common, "shrink": False}).generated()]
    monkeypatch.setattr(refine, "WATCH", 16)
    monkeypatch.setattr(planner, "AHEAD", 8)
    replays, pause = Scheduler._replays, 1.0  # a 128-iteration window takes ~0.4 s on 2 cores
    monkeypatch.setattr(Scheduler, "_replays", lambda self, *args: (time.sleep(pause), replays(self, *args))[1])
    shrink, rows = Scheduler._shrink, []
    monkeypatch.setattr(Scheduler, "_shrink", lambda self: (shrink(self), rows.append(self.rows)))
    monkeypatch.setattr(refine.Refinement, "thresholds", lambda self, floor: {s: 1.0 for s in self.replayed})
    plan = planner.Plan((Prediction(PLAIN, 100.0, 1.0, 0.02), Prediction(NGRAM, 100.0, 2.0, 0.04)), PLAIN, "table:t.json", 1024)
    for script in ([], [NGRAM, PLAIN]):
        decisions, rows[:] = iter(script), []
        monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (
            next(decisions, None) or current, "scripted"))
        run = run_generation(params, cfg, batch, plan=plan, **common)
        assert [g.tolist() for g in run.generated()] == reference
        segments = run.auto.segments
        assert all(s["watch"] for s in segments) and all(s["iterations"] * s["iteration_s"] < pause for s in segments)
        # the first shrinkable call ends at the shrink, its window replayed and decided at once
        # the segment ngram ran ahead while its window was judged is recorded too, and the switch comes after it
        assert [(s["strategy"], s["iterations"]) for s in segments][:4] == (
            [("plain", 16), ("plain", 32), ("plain", 41), ("plain", 128)] if not script else
            [("plain", 16), ("ngram g4", 16), ("ngram g4", 8), ("plain", 13)])
        assert [(s["from"], s["to"], s["iteration"]) for s in run.auto.switches] == [
            (a.name, b.name, i) for a, b, i in zip((PLAIN, *script), script, (16, 40))]
        assert rows == [2]
        stats = jax.device_get(run.output.stats)
        assert sum(s["iterations"] for s in segments) == stats.iterations.max()  # every iteration in a segment
        drawn = 1 + len(run.auto.switches)  # the prefill's token and each switch's plain step
        for b, generated in enumerate(reference):  # a row's last iteration may draft past its limit
            assert 0 <= drawn + stats.iterations[b] + stats.accepted[b] - len(generated) <= NGRAM.gamma, b


def test_device_watch_judges_no_window_too_late_for_a_switch(tiny, monkeypatch):
    """A window ending with fewer than WATCH tokens left is not judged (`Refinement.watch_until`):
    with every threshold at one token an iteration, a static batch of 59 decode iterations crosses at
    its first window (16 iterations, 43 left: the host decides); its second (32 iterations) would end
    with 11 left, so the call runs to the end of the batch, nothing decided (judged, it would have
    ended there: segments of 16, 32 and 11)."""
    cfg, params, batch = tiny
    common = dict(sampling=SamplingConfig(), max_len=128, max_new_tokens=60, stop_ids=(), spec=SpecConfig())
    reference = run_generation(params, cfg, batch, **common)
    monkeypatch.setattr(refine, "WATCH", 16)
    monkeypatch.setattr(refine.Refinement, "thresholds", lambda self, floor: {s: 1.0 for s in self.replayed})
    decided = []
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (
        decided.append(current) or current, "scripted"))
    plan = planner.Plan((Prediction(PLAIN, 100.0, 1.0, 0.02), Prediction(NGRAM, 100.0, 2.0, 0.04)), PLAIN, "table:t.json", 1024)
    run = run_generation(params, cfg, batch, plan=plan, **common)
    assert [g.tolist() for g in run.generated()] == [g.tolist() for g in reference.generated()]
    assert [s["iterations"] for s in run.auto.segments] == [16, 43] and decided == [PLAIN]


def test_a_closed_batch_settled_on_a_drafter_decodes_in_one_call(tiny, monkeypatch):
    """A closed batch watches a drafter on the device: a table's from its first iteration, the cost
    model's once its first segment settles on it. With no replay crossing and the drafter over its
    floor, the rest of the run is one call; with every window under the floor, each call ends at its
    window (WATCH, 2 WATCH, ...) and the host judges it (scripted here to stay), with an ngram candidate
    to replay or none. All emit plain decoding's tokens (the tiny model's text repeats: vegas takes ~7
    tokens an iteration)."""
    cfg, params, batch = tiny
    common = dict(sampling=SamplingConfig(), max_len=200, max_new_tokens=150, stop_ids=(), spec=SpecConfig())
    reference = [g.tolist() for g in run_generation(params, cfg, batch, **common).generated()]
    monkeypatch.setattr(refine, "WATCH", 2)
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (current, "scripted"))
    monkeypatch.setattr(refine.Refinement, "thresholds", lambda self, floor: {s: math.inf for s in self.replayed})
    candidates = (Prediction(VEGAS, 100.0, 2.0, 0.02), Prediction(PLAIN, 60.0, 1.0, 0.02),
                  Prediction(NGRAM, 50.0, 1.5, 0.03))
    for source in ("table:t.json", "cost-model"):
        first = [] if source.startswith("table:") else [planner.SEGMENT]  # the cost model's drafter is refined first
        for own_floor, plan in ((0.0, candidates), (math.inf, candidates), (math.inf, candidates[:2])):  # no ngram
            monkeypatch.setattr(refine.Refinement, "own_floor", lambda self: own_floor)
            run = run_generation(params, cfg, batch, plan=planner.Plan(plan, VEGAS, source, 1024), **common)
            assert [g.tolist() for g in run.generated()] == reference
            iterations = [s["iterations"] for s in run.auto.segments]
            total = int(jax.device_get(run.output.stats).iterations.max())
            assert sum(iterations) == total and not run.auto.switches
            if own_floor == 0:
                assert iterations == first + [total - sum(first)], source
            else:
                assert iterations[: len(first) + 2] == first + [2, 4] and len(iterations) >= len(first) + 3, source


def test_replays_queued_behind_a_window_are_its_replays(tiny, monkeypatch):
    """The refinement's replays run on the device, queued behind the segment that ends a window
    (`programs.replays`); what the host reads from them equals `Ngram.replay` over that window's
    committed tokens (the rows that ran all of it, from its start to the latest report), at every
    refinement segment and watch window of a run that drafts with ngram g4 and replays ngram g2."""
    from jaxspec.decoding.drafters import make_drafter
    from jaxspec.serving.scheduler import Scheduler

    cfg, params, batch = tiny
    monkeypatch.setattr(refine, "WATCH", 16)
    monkeypatch.setattr(planner, "AHEAD", 8)
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (current, "scripted"))
    g2 = planner.Strategy("ngram", gamma=2)
    plan = planner.Plan(tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (NGRAM, g2, PLAIN)), NGRAM, "table:t.json", 1024)
    replays, checked = Scheduler._replays, []

    def checked_replays(self, since, replayed):
        got = replays(self, since, replayed)
        whole = planner.whole_rows(since, self._last)
        end = self._last[0]
        start = np.where(whole, since[0], end)
        for strategy, seen in got.items():  # the tokens up to `end` are the window's, whatever ran after it
            drafter = make_drafter(strategy.spec(self.base), self.cfg, self.max_len)
            iterations = drafter.replay(self._state.tokens, jnp.asarray(start), jnp.asarray(end))
            checked.append(seen == Observation.replayed(end - start, np.asarray(iterations), whole))
        return got

    monkeypatch.setattr(Scheduler, "_replays", checked_replays)
    run = run_generation(params, cfg, batch, plan=plan, sampling=SamplingConfig(), max_len=240, max_new_tokens=200,
                         stop_ids=(), spec=SpecConfig())
    assert len(run.auto.segments) >= 3 and len(checked) == len(run.auto.segments) and all(checked)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 0.05])  # greedy: a special case, slow
def test_ngram_replay_takes_the_iterations_of_the_run_it_replays(tiny, temperature):
    """Replaying ngram over the tokens an ngram run committed takes that run's iterations, row by
    row, greedy and sampled (a one-hot draft is accepted iff the target's draw equals it); over the
    same text another gamma takes other counts."""
    from jaxspec.decoding.drafters import make_drafter

    cfg, params, batch = tiny
    spec, max_len = SpecConfig(method="ngram", gamma=4), 128
    run = run_generation(params, cfg, batch, spec=spec, sampling=SamplingConfig(temperature=temperature), max_len=max_len,
                         max_new_tokens=90, stop_ids=(), seed=3)
    out = jax.device_get(run.output)
    assert (out.stats.accepted > 10).all()  # drafts accepted: matches to find
    start, end, tokens = jnp.asarray(out.prompt_len + 1), jnp.asarray(out.length), jnp.asarray(out.tokens)  # token 1: prefill's
    replay = lambda s: np.asarray(jax.jit(make_drafter(s, cfg, max_len).replay)(tokens, start, end))
    np.testing.assert_array_equal(replay(spec), out.stats.iterations)
    assert (replay(dataclasses.replace(spec, gamma=2)) > out.stats.iterations).any()


def test_auto_run_replays_ngram_and_stays_lossless(tiny, monkeypatch):
    """A greedy auto run that starts on vegas replays ngram over the text it commits (which repeats
    itself on this model), switches to it on the replay, watches it in windows of WATCH or more once settled,
    and emits plain decoding's tokens whatever it switches to."""
    cfg, params, batch = tiny
    common = dict(sampling=SamplingConfig(), max_len=320, max_new_tokens=280, stop_ids=())
    reference = run_generation(params, cfg, batch, spec=SpecConfig(), **common)
    monkeypatch.setattr(refine, "WATCH", 16)
    vegas = Strategy("vegas", gamma=4, ratio=0.07)
    # ngram's iteration predicted 10x cheaper than vegas's: it wins once its replay copies anything
    candidates = (Prediction(vegas, 100.0, 1.1, 0.022), Prediction(PLAIN, 90.0, 1.0, 0.022),
                  Prediction(NGRAM, 909.0, 1.0, 0.0022))
    run = run_generation(params, cfg, batch, plan=planner.Plan(candidates, vegas, "test", 1024), spec=SpecConfig(), **common)
    assert [g.tolist() for g in run.generated()] == [g.tolist() for g in reference.generated()]
    first = run.auto.switches[0]
    assert (first["from"], first["to"]) == ("vegas g4 r0.07", "ngram g4") and "replayed" in first["reason"]
    assert run.auto.segments[0]["replayed_tokens_per_iteration"]["ngram g4"] > 1
    watched = [s for s in run.auto.segments if s["watch"]]
    assert watched and all(s["iterations"] >= 16 for s in watched)


@pytest.mark.slow  # the default run's 20 minutes: switching is test_switching_strategies_keeps_greedy_output's
def test_switch_under_sampling_keeps_shapes(tiny):
    """A sampled run switches from a tree to a chain: tokens, stats and drafter state take the new
    strategy's shapes and rows keep decoding."""
    from jaxspec.decoding import engine
    from jaxspec.runner import decode_fns, prefill_fn

    cfg, params, batch = tiny
    max_len, sampling = 64, SamplingConfig(temperature=0.7)
    ids, lengths = jnp.asarray(batch.ids), jnp.asarray(batch.lengths)
    old, new = TREE.spec(SpecConfig()), VEGAS.spec(SpecConfig())
    start, decode = decode_fns(cfg, old, sampling, max_len)
    state = start(params, prefill_fn(cfg, max_len, "reference", 256)(params, ids, lengths), ids, lengths,
                  key=jax.random.key(0), budget=old.budget(), max_new_tokens=jnp.int32(30), stop_ids=jnp.asarray([-1]))
    state = decode(params, state, max_iterations=jnp.int32(2))
    length = np.asarray(state.length)
    switched = jax.jit(engine.Engine(cfg, new.compiled(max_len), sampling, max_len).switch)(params, state, new.budget())
    assert switched.tokens.shape == (2, max_len + 7) and switched.stats.accepted_by_depth.shape == (2, 6)
    assert (np.asarray(switched.length) == length + 1).all() and int(switched.stats.iterations.sum()) == 0
    assert (np.asarray(switched.tokens[:, :max_len])[:, : length.min()] == np.asarray(state.tokens)[:, : length.min()]).all()
    done = decode_fns(cfg, new, sampling, max_len)[1](params, switched, max_iterations=jnp.int32(10**6))
    assert (np.asarray(done.length) == np.asarray(batch.lengths) + 30).all()


def test_cli_auto_end_to_end(hf_checkpoints, tmp_path, capsys):
    """generate's default is auto: lossless greedy output, the plan and any switch in the stats, and
    a planner table (here one that ranks ngram first) through --planner-table."""
    model = str(hf_checkpoints["llama"])
    run = ["--model", model, "--prompt", "hello there", "--prompt", "The quick brown fox", "--max-new-tokens", "24", "--json"]
    generate.main(run + ["--method", "plain"])
    plain = json.loads(capsys.readouterr().out)
    generate.main(run)
    auto = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in auto["results"]] == [r["tokens"] for r in plain["results"]]
    stats = auto["stats"]
    assert stats["method_requested"] == "auto" and stats["planned"]["source"] == "cost-model"
    assert stats["lossless"] and stats["precision"] == "strict" and stats["method"] == stats["strategy"]["method"]
    assert stats["strategy"]["name"] == (stats["switches"][-1]["to"] if stats["switches"] else stats["planned"]["strategy"])
    assert plain["stats"]["method_requested"] == "plain"

    from jaxspec.loaders import load_model

    cfg = load_model(model, "float32")[0]
    path = tmp_path / "table.json"
    tables.save_table(path, table(cfg, cells=[(2, "greedy", 1024, "strict", [entry(PLAIN, 100, 1, 2), entry(NGRAM, 1000, 5, 2)])]))
    generate.main(run + ["--planner-table", str(path)])
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["planned"] | {"candidates": None} == {"strategy": "ngram g4", "source": f"table:{path}", "bucket": 1024,
                                                       "predicted_tokens_per_s": 1000, "candidates": None}
    generate.main(run[:-1] + ["--planner-table", str(path)])  # the human block names the strategy
    assert "strategy         " in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["--gamma", "4"], "--method auto chooses --gamma"),
    (["--tree", "2,2", "--ratio", "0.1"], "--tree, --ratio"),
    (["--method", "vegas", "--planner-table", "t.json"], "--planner-table is for --method auto"),
    (["--precision", "approx"], "needs an NSA model"),
    (["--method", "vegas", "--precision", "reuse"], "needs an NSA model"),
    (["--precision", "exact"], "--precision"),
    (["--method", "vegas", "--group", "-1"], "--group"),
])
def test_cli_auto_errors(hf_checkpoints, capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", str(hf_checkpoints["llama"]), "--prompt", "hi", "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_cli_bad_planner_table(hf_checkpoints, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit):
        generate.main(["--model", str(hf_checkpoints["llama"]), "--prompt", "hi", "--planner-table", str(bad)])
    assert capsys.readouterr().err.startswith("error: cannot read planner table")


def test_profile_writes_a_valid_table(hf_checkpoints, llama_deep_head, tmp_path, capsys, monkeypatch):
    """The table's cell ranks every strategy of the space (read back as profiled); eagle's entries
    record the --draft-model head, so a run with that head plans with them and one without does not."""
    from jaxspec.loaders.eagle import head_fingerprint

    out, model = tmp_path / "table.json", str(hf_checkpoints["llama_deep"])
    profile.main(["--model", model, "--buckets", "96", "--new", "6", "--repeats", "2", "--samplings", "greedy",
                  "--methods", "plain,vegas,eagle", "--gammas", "2", "--trees", "dfs:2,1", "--ratios", "0.5",
                  "--select-every", "2", "--draft-model", str(llama_deep_head), "--out", str(out)])
    t = tables.load_table(out)
    assert [(c["bucket"], c["sampling"], c["batch"]) for c in t["cells"]] == [(96, "greedy", 1)]
    names = [e["name"] for e in t["cells"][0]["ranked"]]
    assert sorted(names) == ["eagle dfs:2,1", "eagle g2", "plain", "vegas dfs:2,1 r0.5 every 2", "vegas g2 r0.5 every 2"]
    spaced = Strategy("vegas", gamma=2, ratio=0.5, select_every=2)
    assert spaced in [Strategy.from_json(e["strategy"]) for e in t["cells"][0]["ranked"]]  # read back as profiled
    assert all(e["runs"] == 2 and e["tokens_per_s"] > 0 for c in t["cells"] for e in c["ranked"])
    heads = {e["name"]: e.get("head") for e in t["cells"][0]["ranked"]}
    assert {heads["eagle g2"], heads["eagle dfs:2,1"]} == {head_fingerprint(llama_deep_head)}
    assert {v for name, v in heads.items() if not name.startswith("eagle")} == {None}
    methods = lambda head: {p.strategy.method for p in tables.lookup(t, 1, "greedy", 96, head=head)[1]}
    assert methods(heads["eagle g2"]) == {"plain", "vegas", "eagle"} and methods(None) == {"plain", "vegas"}
    assert "| sampling | batch | bucket |" in capsys.readouterr().out
    first = {k: t["cells"][0][k] for k in tables.PROVENANCE}
    assert first["new_tokens"] == 6 and first["repeats"] == 2 and "--buckets 96" in first["command"]
    # a budget spent at once keeps the cells already there and adds plain alone for a new bucket; the
    # kept cell keeps how it was measured, and a cell of a table written before cells recorded it gets
    # its old header's
    del t["cells"][0]["repeats"]
    tables.save_table(out, t)
    clock = iter([0.0, 0.0])  # the run starts and opens its bucket in time; every later look finds it spent
    monkeypatch.setattr(profile, "time", SimpleNamespace(monotonic=lambda: next(clock, 1e9)))
    profile.main(["--model", model, "--buckets", "64", "--new", "5", "--repeats", "1",
                  "--samplings", "greedy", "--budget", "0.5", "--out", str(out)])
    monkeypatch.undo()
    t = tables.load_table(out)
    assert [c["bucket"] for c in t["cells"]] == [96, 64] and [e["name"] for e in t["cells"][1]["ranked"]] == ["plain"]
    assert {k: t["cells"][0][k] for k in tables.PROVENANCE} == first
    assert (t["cells"][1]["new_tokens"], t["cells"][1]["repeats"], t["profile"]["new_tokens"]) == (5, 1, 5)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # no head ships for this model
        profile.main(["--model", str(hf_checkpoints["llama"]), "--methods", "plain,eagle", "--out", str(out)])
    assert capsys.readouterr().err.startswith("error: --methods eagle needs a draft head")


def test_profile_runs_each_calibration_batch_in_turn(hf_checkpoints, tmp_path, monkeypatch):
    """One batch's cache at a time: a budget spent during the first batch still gives every strategy
    it measured the same runs, and a later batch is started only in time (a clock that ticks a second
    a reading: the start, the bucket's check, one check per strategy of the first batch, then the
    second batch's)."""
    prefills, real = [], profile.prefill_fn

    def counting(*args):
        fn = real(*args)
        return lambda *a: prefills.append(1) or fn(*a)

    monkeypatch.setattr(profile, "prefill_fn", counting)
    flags = ["--model", str(hf_checkpoints["llama"]), "--buckets", "64", "--new", "4", "--repeats", "2",
             "--samplings", "greedy", "--methods", "plain,vegas", "--gammas", "2", "--trees", "--ratios", "0.5"]
    for budget, runs in ((3.5, 1), (10.5, 2)):  # 2 strategies: the second batch's check reads 4 s
        clock = iter(range(100))
        monkeypatch.setattr(profile, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(clock))}))
        prefills.clear()
        out = tmp_path / f"budget{budget}.json"
        profile.main(flags + ["--budget", str(budget), "--out", str(out)])
        ranked = tables.load_table(out)["cells"][0]["ranked"]
        assert sorted(e["name"] for e in ranked) == ["plain", "vegas g2 r0.5"]
        assert [e["runs"] for e in ranked] == [runs, runs] and len(prefills) == runs


def test_profile_leaves_each_strategys_first_run_untimed(hf_checkpoints, tmp_path, monkeypatch):
    """A strategy's first run pays its program's first execution once (`runner.timed_runs`): it is
    run untimed, so an entry holds the timed runs alone (here a fake first run 10x slower than the
    others, and the one that compiles: its compile time is the entry's)."""
    calls = []

    def fake(params, cfg, batch, cache, spec, *rest):
        calls.append(spec.method)
        first = calls.count(spec.method) == 1
        return (10.0 if first else 100.0 + len(calls), 1.0, 0.001, 7.0 if first else 0.0)

    monkeypatch.setattr(profile, "run_once", fake)
    out = tmp_path / "table.json"
    profile.main(["--model", str(hf_checkpoints["llama"]), "--buckets", "64", "--new", "4", "--repeats", "2",
                  "--samplings", "greedy", "--methods", "plain,vegas", "--gammas", "2", "--trees", "--ratios", "0.5",
                  "--out", str(out)])
    assert calls == ["plain", "plain", "vegas", "vegas", "plain", "vegas"]
    ranked = {e["name"]: e for e in tables.load_table(out)["cells"][0]["ranked"]}
    measured = {n: (e["runs"], e["tokens_per_s"]) for n, e in ranked.items()}
    assert measured == {"plain": (2, 103.5), "vegas g2 r0.5": (2, 105.0)}
    assert [e["compile_s"] for e in ranked.values()] == [7.0, 7.0]


def test_profile_add_keeps_what_it_does_not_measure(hf_checkpoints, tmp_path, monkeypatch):
    """`--add`: a cell measured again keeps its entries for strategies this run does not measure, each
    stamped with the run that measured it; what it measures (plain here) is the new run's. Without it
    the cell is replaced whole. An eagle entry is kept beside another head's of the same strategy."""
    rate = iter(range(100, 1000, 10))
    monkeypatch.setattr(profile, "run_once", lambda *args: (float(next(rate)), 1.5, 0.001, 0.0))
    out = tmp_path / "table.json"
    flags = ["--model", str(hf_checkpoints["llama"]), "--buckets", "64", "--new", "4", "--repeats", "1",
             "--samplings", "greedy", "--gammas", "2", "--trees", "--ratios", "0.5", "--out", str(out)]
    profile.main(flags + ["--methods", "plain,vegas"])
    first = tables.load_table(out)["cells"][0]
    before = {e["name"]: e["tokens_per_s"] for e in first["ranked"]}
    profile.main(flags + ["--methods", "plain,ngram", "--add"])
    (cell,) = tables.load_table(out)["cells"]
    ranked = {e["name"]: e for e in cell["ranked"]}
    assert sorted(ranked) == ["ngram g2", "plain", "vegas g2 r0.5"]
    assert ranked["vegas g2 r0.5"]["tokens_per_s"] == before["vegas g2 r0.5"]
    assert ranked["vegas g2 r0.5"]["measured"] == {k: first[k] for k in tables.PROVENANCE}
    assert ranked["plain"]["tokens_per_s"] != before["plain"] and "measured" not in ranked["plain"]
    assert "--add" in cell["command"] and [e["tokens_per_s"] for e in cell["ranked"]] == sorted(
        (e["tokens_per_s"] for e in cell["ranked"]), reverse=True)
    profile.main(flags + ["--methods", "plain"])
    assert [e["name"] for e in tables.load_table(out)["cells"][0]["ranked"]] == ["plain"]

    eagle = lambda head, tps: {"strategy": Strategy("eagle", gamma=3).to_json(), "head": head, "tokens_per_s": tps,
                               "tokens_per_iteration": 2.0, "iteration_s": 0.001}
    plain = lambda tps: {"strategy": Strategy("plain").to_json(), "tokens_per_s": tps, "tokens_per_iteration": 1.0,
                         "iteration_s": 0.001}
    t = {"cells": []}
    tables.set_cell(t, 1, "greedy", 64, "strict", [plain(100.0), eagle("a", 150.0)], new_tokens=4, date="d1")
    tables.set_cell(t, 1, "greedy", 64, "strict", [plain(101.0), eagle("b", 160.0)], keep=True, new_tokens=4, date="d2")
    (cell,) = t["cells"]
    assert [(e.get("head"), e["tokens_per_s"], e.get("measured", {}).get("date")) for e in cell["ranked"]] == [
        ("b", 160.0, None), ("a", 150.0, "d1"), (None, 101.0, None)]


def test_profile_eagle_cells_measures_a_new_head_where_the_old_one_answers(hf_checkpoints, llama_deep_head, tmp_path,
                                                                         monkeypatch, capsys):
    """`--eagle-cells`: plain and eagle with the new head, in each cell that ranks the old head's eagle
    entries, with that cell's own settings and eagle shapes, one run per (sampling, batch); the cell keeps
    its other entries, a cell without eagle entries is left as it was, the command each cell records
    repeats its run, and a second run finds nothing left to measure. A grid flag beside it is an error."""
    from jaxspec.loaders.eagle import head_fingerprint, load_eagle, save_eagle
    from jaxspec.loaders import load_config

    model = str(hf_checkpoints["llama_deep"])
    ecfg, weights = load_eagle(llama_deep_head, load_config(model, "float32"), "float32")
    new_head = tmp_path / "new_head"
    save_eagle(new_head, ecfg, {**weights, "fc": weights["fc"] * np.float32(1.01)})
    old_id, new_id = head_fingerprint(llama_deep_head), head_fingerprint(new_head)
    assert old_id != new_id
    rate = iter(range(100, 100000, 7))
    calls = []

    def fake(params, cfg, batch, cache, spec, sampling, max_len, new, seed):
        calls.append((spec.method, "greedy" if sampling.greedy else "sample", batch.ids.shape[0], new))
        return float(next(rate)), 1.5, 0.001, 0.0

    monkeypatch.setattr(profile, "run_once", fake)
    out = tmp_path / "table.json"
    flags = ["--model", model, "--ratios", "0.5", "--out", str(out), "--draft-model", str(llama_deep_head)]
    profile.main(flags + ["--buckets", "64,80", "--new", "4", "--repeats", "2", "--samplings", "greedy",
                          "--methods", "plain,vegas,eagle", "--gammas", "2", "--trees", "dfs:2,1"])
    profile.main(flags + ["--buckets", "64", "--new", "5", "--repeats", "1", "--samplings", "sample", "--batch", "2",
                          "--methods", "plain,eagle", "--gammas", "", "--trees", "3,1"])
    profile.main(flags + ["--buckets", "96", "--new", "4", "--repeats", "1", "--samplings", "greedy",
                          "--methods", "plain,vegas", "--gammas", "3", "--trees"])
    before = tables.load_table(out)["cells"]
    calls.clear()
    capsys.readouterr()
    profile.main(["--model", model, "--out", str(out), "--draft-model", str(new_head), "--eagle-cells"])
    assert f"the head {new_id}: 2 (one per" in capsys.readouterr().out
    assert sorted(set(calls)) == [("eagle", "greedy", 1, 4), ("eagle", "sample", 2, 5), ("plain", "greedy", 1, 4),
                                  ("plain", "sample", 2, 5)]
    after = tables.load_table(out)["cells"]
    key = lambda c: (c["sampling"], c["batch"], c["bucket"])
    assert sorted(map(key, after)) == sorted(map(key, before))
    for cell in after:
        old = next(c for c in before if key(c) == key(cell))
        eagle = lambda c, head: sorted(e["name"] for e in c["ranked"] if e.get("head") == head)
        if not eagle(old, old_id):
            assert cell == old
            continue
        assert eagle(cell, new_id) == eagle(cell, old_id) == eagle(old, old_id)
        assert all("measured" in e for e in cell["ranked"] if e["strategy"]["method"] not in ("plain",)
                   and e.get("head") != new_id)
        assert (cell["new_tokens"], cell["repeats"]) == (old["new_tokens"], old["repeats"])
        rerun = profile.parse_args(shlex.split(cell["command"])[3:])
        assert (rerun.buckets, rerun.batch, rerun.samplings, rerun.new, rerun.methods, rerun.add) == (
            (64, 80) if cell["sampling"] == "greedy" else (64,), (cell["batch"],), (cell["sampling"],),
            cell["new_tokens"], ("plain", "eagle"), True)
    calls.clear()
    profile.main(["--model", model, "--out", str(out), "--draft-model", str(new_head), "--eagle-cells"])
    assert calls == [] and "nothing to measure" in capsys.readouterr().out
    assert tables.load_table(out)["cells"] == after
    t = tables.load_table(out)  # a run cut short inside a cell: the head's entries for some shapes only
    cell = next(c for c in t["cells"] if c["sampling"] == "greedy" and c["bucket"] == 80)
    cell["ranked"].remove(next(e for e in cell["ranked"] if e.get("head") == new_id))
    tables.save_table(out, t)
    profile.main(["--model", model, "--out", str(out), "--draft-model", str(new_head), "--eagle-cells"])
    assert {c[1:] for c in calls} == {("greedy", 1, 4)} and f"{new_id}: 1 (one per" in capsys.readouterr().out
    # a budget spent once the first bucket's plain is measured, plain and one of its two eagle shapes, or its
    # first batch of two: that cell is not written, it keeps its own (its old plain entry is not traded for
    # fewer runs)
    t = tables.load_table(out)
    cell = next(c for c in t["cells"] if c["sampling"] == "greedy" and c["bucket"] == 64)
    cell["ranked"].remove(next(e for e in cell["ranked"] if e.get("head") == new_id))
    tables.save_table(out, t)
    # readings in time: the run's start, its first group's check, the bucket's, one per strategy, the next batch's
    for in_time, ran in ((3, ["plain", "plain"]), (5, ["plain", "plain", "eagle", "eagle"]),
                         (6, ["plain", "plain"] + ["eagle"] * 4)):
        clock = iter([0.0] * in_time)
        monkeypatch.setattr(profile, "time", SimpleNamespace(monotonic=lambda: next(clock, 1e9)))
        calls.clear()
        with pytest.raises(SystemExit):
            profile.main(["--model", model, "--out", str(out), "--draft-model", str(new_head), "--eagle-cells",
                          "--budget", "1"])
        assert [c[0] for c in calls] == ran and tables.load_table(out) == t
        assert "the budget ran out before a cell was measured" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile.main(["--model", model, "--out", str(out), "--eagle-cells", "--buckets", "64"])
    assert capsys.readouterr().err.strip() == (
        "error: --eagle-cells takes each cell's settings from the table: drop --buckets")
    for table, dtype, fragment in ((tmp_path / "none.json", "float32", "no table at"),
                                   (out, "bfloat16", "not of this model")):  # another model's: not measured over
        with pytest.raises(SystemExit):
            profile.main(["--model", model, "--dtype", dtype, "--out", str(table), "--eagle-cells",
                          "--draft-model", str(new_head)])
        assert fragment in capsys.readouterr().err
    assert tables.load_table(out) == t
    # --replace: a third head takes the cells' place; every other head's eagle entries go, the rest stay
    third = tmp_path / "third_head"
    save_eagle(third, ecfg, {**weights, "fc": weights["fc"] * np.float32(0.99)})
    profile.main(["--model", model, "--out", str(out), "--draft-model", str(third), "--eagle-cells", "--replace"])
    replaced = tables.load_table(out)["cells"]
    assert sorted(map(key, replaced)) == sorted(map(key, before))
    for cell in replaced:
        heads = {e.get("head") for e in cell["ranked"] if e["strategy"]["method"] == "eagle"}
        old = next(c for c in t["cells"] if key(c) == key(cell))
        assert heads == ({head_fingerprint(third)} if any(e.get("head") for e in old["ranked"]) else set())
        assert {e["name"] for e in cell["ranked"] if "measured" in e} == {
            e["name"] for e in old["ranked"] if e["strategy"]["method"] not in ("plain", "eagle")} or cell == old
    with pytest.raises(SystemExit):
        profile.main(flags + ["--methods", "plain", "--add", "--replace"])
    assert "--replace needs --eagle-cells, or --add with --methods eagle" in capsys.readouterr().err


def test_profile_of_requests_keeps_the_document_cells(hf_checkpoints, tmp_path, capsys):
    """`--prompts requests`: the calibration prompts are corpus.REQUESTS in turn (short, whatever the
    bucket), recorded as a cell of their own beside the same bucket's document cell; a bucket that
    cannot hold a request is a one-line error."""
    from jaxspec import corpus
    from jaxspec.loaders import load_model
    from jaxspec.runner import encode_prompts

    model, out = hf_checkpoints["llama"], tmp_path / "t.json"
    flags = ["--model", str(model), "--new", "4", "--repeats", "2", "--samplings", "greedy", "--methods", "plain",
             "--out", str(out)]
    profile.main(flags + ["--buckets", "200"])  # this tokenizer's requests are ~100 tokens with the template
    profile.main(flags + ["--buckets", "200", "--prompts", "requests"])
    cells = tables.load_table(out)["cells"]
    assert [(c["bucket"], tables.prompt_kind(c)) for c in cells] == [(200, "documents"), (200, "requests")]
    _, _, tokenizer = load_model(str(model), dtype="float32")
    lengths = encode_prompts(tokenizer, list(corpus.REQUESTS[:2]), tokenizer.has_chat_template).lengths
    assert cells[1]["prompt_tokens"] == int(np.mean(lengths)) < cells[0]["prompt_tokens"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        profile.main(flags + ["--buckets", "12", "--prompts", "requests"])
    error = capsys.readouterr().err
    assert error.startswith("error: a bucket of 8 prompt tokens is too small for the calibration requests")


def test_profile_strategy_space_for_nsa_models():
    nsa = SMOLLM2.replace(model_type="llama-nsa", nsa=NSAConfig(block_size=16, block_counts=16, window_size=128))
    tree = profile.parse_tree("3,2,1")
    space = profile.strategy_space(nsa, ("plain", "vegas", "ngram"), (4,), [tree], (0.07,), (1, 8), ("strict", "approx"))
    assert space[:2] == [PLAIN, Strategy(precision="approx")]
    assert len(space) == 2 + 2 * 2 * 2 * 2  # methods x shapes x groups x precisions
    dense = profile.strategy_space(SMOLLM2, ("plain", "vegas"), (4,), [tree], (0.03, 0.07), (1, 8), ("strict", "approx"))
    assert len(dense) == 1 + 2 * 2 and {s.precision for s in dense} == {"strict"} and {s.group for s in dense} == {0}
    # draft weights: every model drafter with each kind, full with the quantized one only, ngram exact
    drafts = profile.strategy_space(SMOLLM2, ("plain", "vegas", "full", "ngram"), (4,), [], (0.07,), (8,), ("strict",),
                                    ("exact", "int8"))
    assert [s.name for s in drafts] == ["plain", "vegas g4 r0.07", "vegas g4 r0.07 int8", "full g4 int8", "ngram g4"]
    # selection spacing: score methods only
    spaced = profile.strategy_space(SMOLLM2, ("plain", "vegas", "stream", "ngram"), (4,), [], (0.07,), (8,), ("strict",),
                                    select_every=(1, 2))
    assert [s.name for s in spaced] == ["plain", "vegas g4 r0.07", "vegas g4 r0.07 every 2", "stream g4 r0.07", "ngram g4"]
    # a shared budget: sparse methods only
    shared = profile.strategy_space(SMOLLM2, ("plain", "vegas", "stream", "ngram"), (4,), [], (0.07,), (8,), ("strict",),
                                    balances=(1.0, 2.0))
    assert [s.name for s in shared] == ["plain", "vegas g4 r0.07", "vegas g4 r0.07 balance 2", "stream g4 r0.07",
                                        "stream g4 r0.07 balance 2", "ngram g4"]
    for flags, fragment in ((["--select-every", "2,2"], "twice"), (["--methods", "plain,ngram", "--select-every", "1,2"], "has none"),
                            (["--select-every", "0"], "between 1"), (["--balances", "1,1"], "twice"),
                            (["--methods", "plain,ngram", "--balances", "2"], "has none"), (["--balances", "0.5"], "between 1")):
        with pytest.raises(JaxspecError, match=fragment):
            profile.check_args(profile.parse_args(flags))
