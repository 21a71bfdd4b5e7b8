"""The planner's lookup tables: their format, files, and the lookup of a run's cell.

A table is measured by `python -m jaxspec.profile` for one model on one device kind: per batch size,
sampling mode (greedy / sample: acceptance differs), context bucket and precision class, the
strategies ranked by measured decode tokens/s. Tables ship in `planner/tables/`, named by the model's
fingerprint and the device kind (`table_path`), and are found automatically.

Context buckets: a run belongs to the smallest bucket (upper bound in tokens, BUCKETS) that holds its
longest prompt plus its new tokens, i.e. the longest context it reaches; the profile measures each
bucket at its top (prompts of bucket - new tokens). A table without that bucket answers from the
nearest profiled one (by log distance) and from the nearest profiled batch size, each if it is within
a factor of 2 of the run's; further away the regime differs (KV reads dominate at batch 16 and not at
batch 1; at batch 128 a 2K context's step is a third of an 8K one's, so vegas that paid at 8K loses
at 2K: bench/NOTES.md, "auto at batch 128"), and the cost model answers instead. A cell's ngram entries measure what ngram could copy
from those prompts, so a run with a much shorter prompt does not use them (PROMPT_SHARE); nor does
it use eagle's, which measure the head on those prompts' kind of text. An eagle entry records the
draft head it measured (`loaders.eagle.head_fingerprint`): it answers only for runs with that head.

A cell's tokens/s is a static batch's, which lasts as long as its slowest row: `Prediction.tail`
says how much of the mean row's rate that kept, at the run's length (`run_tail`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import jax

from jaxspec import files
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import PRECISIONS
from jaxspec.errors import JaxspecError
from jaxspec.models.config import ModelConfig
from jaxspec.planner.strategy import Prediction, Strategy

BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TABLES = Path(__file__).parent / "tables"  # shipped tables: <fingerprint>_<device>.json
TABLE_FORMAT = 1
# ngram drafts copy n-grams of the prompt and the text so far, so its tokens per iteration in a cell
# come from the calibration prompts' text: a run whose prompt is a small share of theirs gets none of
# that (bench/NOTES.md, "the planner's table found again": "ngram and short prompts"). A draft head's
# acceptance depends on the kind of text: measured on the calibration prompts' documents, it says
# little of a short chat request's (bench/NOTES.md, "Issue 59: eagle in the planner").
PROMPT_SHARE = 0.25
PROMPT_DRAFTERS = ("ngram", "eagle")  # whose cell entries need a prompt like the cell's
PROMPT_KINDS = ("documents", "requests")  # a cell's calibration prompts (`jaxspec.profile --prompts`)
DOCUMENTS = PROMPT_KINDS[0]  # the kind of a cell that does not name one
PROVENANCE = ("new_tokens", "repeats", "date", "command")  # how a cell was measured, kept in the cell


def bucket_of(context: int, buckets=BUCKETS) -> int:
    """The smallest bucket holding `context` tokens (the largest one past it)."""
    return next((b for b in sorted(buckets) if context <= b), max(buckets))


def nearest(value: int, options) -> int:
    """The option nearest to `value` by log distance (ties: the smaller)."""
    return min(sorted(options), key=lambda o: abs(math.log(o / value)))


def sampling_mode(sampling: SamplingConfig) -> str:
    """A table cell's sampling mode: greedy or sample."""
    return "greedy" if sampling.greedy else "sample"



# Config fields added after tables were shipped, at the value that leaves a model as it was: left out
# of the hash there, so that the shipped tables keep their names (tests/test_planner.py checks them).
ADDED_FIELDS = {"tp": 1, "moe": None, "o_bias": False, "sinks": False, "sliding_window": 0, "sliding_layers": (),
                "expert_parallel": False}


def fingerprint(cfg: ModelConfig) -> str:
    """A readable, stable model id: '<type>-<layers>x<hidden>-<dtype>-<hash>' where the hash covers
    every shape, NSA and dtype field of the config (not the token ids; ADDED_FIELDS only off their
    old value)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("bos_token_id", "eos_token_ids") and not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{cfg.model_type}-{cfg.num_layers}x{cfg.hidden_size}-{cfg.dtype}-{digest}"


def device_kind() -> str:
    return jax.devices()[0].device_kind


def table_path(cfg: ModelConfig, device: str, directory: Path = TABLES) -> Path:
    """Where the table of this model on this device kind lives: <fingerprint>_<device slug>.json."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return directory / f"{fingerprint(cfg)}_{slug}.json"


def new_table(cfg: ModelConfig, model_name: str, device: str, backend: str, profile: dict) -> dict:
    return {
        "format": TABLE_FORMAT,
        "model": {"name": model_name, "fingerprint": fingerprint(cfg)},
        "device": device,
        "backend": backend,
        "profile": profile,
        "cells": [],
    }


def set_cell(table: dict, batch: int, sampling: str, bucket: int, precision: str, entries: list[dict],
             keep: bool = False, **info) -> None:
    """Adds (or replaces) one cell, its entries ranked by tokens_per_s. An entry is {"strategy":
    Strategy.to_json(), "tokens_per_s", "tokens_per_iteration", "iteration_s", ...}. Cells measured
    over different run lengths (`info["new_tokens"]`) are different cells: `lookup` takes the
    nearest. `keep`: the cell it replaces keeps its entries for strategies (and eagle heads) that
    `entries` lacks, each stamped with how its own run measured it (`measured`: that cell's PROVENANCE),
    so a new draft head is profiled without measuring every other strategy again."""
    key = (batch, sampling, bucket, precision, info.get("new_tokens"), info.get("prompts", DOCUMENTS))
    old = next((c for c in table["cells"] if _cell_key(c) == key), None)
    if keep and old is not None:
        ids = {_entry_id(e) for e in entries}
        stamp = {k: old.get(k) for k in PROVENANCE}
        entries = entries + [{"measured": stamp, **e} for e in old["ranked"] if _entry_id(e) not in ids]
    table["cells"] = [c for c in table["cells"] if _cell_key(c) != key]
    ranked = sorted(entries, key=lambda e: -e["tokens_per_s"])
    table["cells"].append({"batch": batch, "sampling": sampling, "bucket": bucket, "precision": precision, **info,
                           "ranked": ranked})


def provenance(table: dict, cell: dict) -> dict:
    """How a cell was measured (PROVENANCE): its own record, or for a cell written before cells kept
    one, the table header's (which then described every run)."""
    return {k: cell.get(k, table["profile"].get(k)) for k in PROVENANCE}


def _entry_id(entry: dict) -> tuple:
    """What an entry measured: its strategy and, for eagle, the head's fingerprint."""
    return json.dumps(entry["strategy"], sort_keys=True), entry.get("head")


def _cell_key(cell: dict) -> tuple:
    return cell["batch"], cell["sampling"], cell["bucket"], cell["precision"], cell.get("new_tokens"), prompt_kind(cell)


def prompt_kind(cell: dict) -> str:
    """The kind of a cell's calibration prompts (`jaxspec.profile --prompts`; older cells: documents)."""
    return cell.get("prompts", DOCUMENTS)


def save_table(path: Path, table: dict) -> None:
    """Writes the table atomically: never half-written."""
    files.write_text(path, json.dumps(table, indent=1) + "\n")


def load_table(path: Path) -> dict:
    """Reads and checks a table; any problem is one JaxspecError naming the file."""
    try:
        table = json.loads(Path(path).read_text())
        if table.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {table.get('format')!r} is not {TABLE_FORMAT}")
        table["model"]["fingerprint"], table["device"]
        if not table["cells"]:
            raise ValueError("no cells")
        for cell in table["cells"]:
            if cell["sampling"] not in ("greedy", "sample") or cell["precision"] not in PRECISIONS:
                raise ValueError(f"bad cell {_cell_key(cell)}")
            if int(cell["batch"]) < 1 or int(cell["bucket"]) < 1:
                raise ValueError(f"bad cell {_cell_key(cell)}")
            strategies = [Strategy.from_json(e["strategy"]) for e in cell["ranked"]]
            if not any(s.plain for s in strategies):
                raise ValueError(f"cell {_cell_key(cell)} has no plain entry")
            for e in cell["ranked"]:
                if not all(float(e[k]) > 0 for k in ("tokens_per_s", "tokens_per_iteration", "iteration_s")):
                    raise ValueError(f"cell {_cell_key(cell)}: non-positive measurement")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, JaxspecError) as e:
        raise JaxspecError(f"cannot read planner table {path}: {e}") from None
    return table


def another_head(entry: dict, head: str | None) -> bool:
    """Whether a ranked `entry` is an eagle strategy measured with another draft head than `head` (its
    `loaders.eagle.head_fingerprint`): another head's acceptance, which says nothing of this one's."""
    return entry["strategy"]["method"] == "eagle" and entry.get("head") != head


def lookup(table: dict, batch: int, sampling: str, context: int, precisions=("strict",),
           prompt_tokens: int | None = None, new_tokens: int | None = None,
           head: str | None = None, any_head: bool = False) -> tuple[int, list[Prediction]]:
    """(bucket, predictions ranked best first) of the cells nearest to this run: the sampling mode
    if profiled (else the other), the nearest batch, the kind of calibration prompts (`prompt_kind`)
    of the cell whose prompts are nearest `prompt_tokens` in length (documents or short requests: their
    acceptance differs), the exact bucket or the nearest profiled one,
    the run length nearest `new_tokens` by ratio (without it, the shortest: a short static batch
    loses more to its slowest row, and how much differs by strategy more than `run_tail` says);
    the entries of every allowed precision class, less ngram's and eagle's where the run's prompt is
    under PROMPT_SHARE of the cell's calibration prompts, and less eagle's but those measured with the
    run's draft head (`head`: its `loaders.eagle.head_fingerprint`, which an eagle entry records;
    `any_head`: every head's, to tell whether the cells measured another head).
    Empty when no cell has an allowed class, or when the nearest profiled batch or bucket is more than
    a factor of 2 from the run's. A cell of another batch answers at its rate per row (tokens/s and
    spread scaled by batch / its batch): the refinement compares these rates with what the run's own
    rows do, and the choice between them is the same at any scale. Given the run's `new_tokens`, a model drafter's tokens/s and tail are
    those of a run that long (`run_tail`)."""
    mismatched = lambda e: not any_head and another_head(e, head)
    cells = [c for c in table["cells"] if c["precision"] in precisions]
    if not cells:
        return bucket_of(context), []
    if any(c["sampling"] == sampling for c in cells):
        cells = [c for c in cells if c["sampling"] == sampling]
    apart = lambda a, b: max(a, b) > 2 * min(a, b)  # another regime: the cost model answers
    b = nearest(batch, {c["batch"] for c in cells})
    if apart(b, batch):
        return bucket_of(context), []
    cells = [c for c in cells if c["batch"] == b]
    if prompt_tokens is not None:  # the kind of calibration prompts nearest this run's prompt in length
        log_apart = lambda c: abs(math.log(max(prompt_tokens, 1) / max(c.get("prompt_tokens", 1), 1)))
        kind = prompt_kind(min(cells, key=log_apart))
        cells = [c for c in cells if prompt_kind(c) == kind]
    bucket = nearest(bucket_of(context), {c["bucket"] for c in cells})
    if apart(bucket_of(context), bucket_of(bucket)):  # on BUCKETS' scale (a profile may name its own)
        return bucket_of(context), []
    cells = [c for c in cells if c["bucket"] == bucket]
    measured = lambda c: c.get("new_tokens") or table["profile"].get("new_tokens", 0)  # older cells: the header's
    far = lambda n: abs(math.log(max(n, 1) / new_tokens)) if new_tokens else n
    length = min({measured(c) for c in cells}, key=lambda n: (far(n), n))
    entries = [(c, e) for c in cells if measured(c) == length for e in c["ranked"]
               if not (e["strategy"]["method"] in PROMPT_DRAFTERS and prompt_tokens is not None
                       and prompt_tokens < PROMPT_SHARE * c.get("prompt_tokens", 0)) and not mismatched(e)]
    predictions = []
    for c, e in entries:
        strategy, tps, tpi = Strategy.from_json(e["strategy"]), float(e["tokens_per_s"]), float(e["tokens_per_iteration"])
        runs = e.get("runs", 0)
        tail = min(1.0, tps * float(e["iteration_s"]) / (tpi * b))
        if new_tokens and measured(c) and strategy.kind in ("model", "eagle"):
            longer = run_tail(tail, measured(c), new_tokens)
            tail, tps = longer, tps * longer / tail
        predictions.append(Prediction(strategy, batch / b * tps, tpi, float(e["iteration_s"]),
                                      batch / b * float(e.get("spread_tokens_per_s", 0.0)),
                                      runs * measured(c) / tpi, runs=runs, tail=tail))
    return bucket, sorted(predictions, key=lambda p: -p.tokens_per_s)


def run_tail(tail: float, measured_tokens: int, new_tokens: int) -> float:
    """A model drafter's or the draft head's tail (`Prediction.tail`) measured over `measured_tokens`
    new tokens, at a run of `new_tokens`. Its rows' acceptance varies iteration by iteration alike, so the slowest
    row's excess iterations over the mean row's shrink as 1 / sqrt(tokens) (checked against longer
    runs: bench/NOTES.md, "a model drafter's tail at the run's length"). ngram's rows differ for good
    (a row that loops copies, one that does not never will): its tail is kept as measured."""
    excess = (1 / tail - 1) * math.sqrt(measured_tokens / new_tokens)
    return 1 / (1 + excess)
