"""The planner behind `--method auto`: which strategy to decode with, and when to switch.

Why: whether speculation pays depends on the regime, and nothing in a method's config knows the
regime. A small model at batch 1 is launch-bound (a sparse draft forward costs as much as a full
one, and speculation runs slower than plain decoding); a large model at long context is bound by its
KV reads, and a sparse drafter runs twice as fast as plain (bench/NOTES.md, "Default `auto` and the
planner"). So a run asks the planner, which answers from three sources, best first:

1. `tables`: a lookup table measured by `python -m jaxspec.profile` for one model on one device kind
   (shipped in `planner/tables/`, found automatically);
2. `cost`: without a table, a cost model from the measured copy bandwidth (bytes floors plus launch
   overheads, and an assumed acceptance);
3. `refine`: refinement at run time: the run measures what it does and switches strategy in place.

`strategy` is what the planner chooses (the part of a SpecConfig it sets, as tables store it) and
what it predicts of it; `plan` makes a run's plan (its candidates and first choice) from 1 or 2.
Plain decoding is always a candidate, and the fallback: a speculative strategy is chosen only when it
is predicted (or measured) MARGIN faster. The planner sits above `decoding` (it builds SpecConfigs
from strategies); decoding does not import it.

The names runs use are importable from here; tools that read or write tables, or use the bytes
floors, import `tables` and `cost`.
"""

from jaxspec.planner.cost import tree_bytes
from jaxspec.planner.plan import Plan, allowed_precisions, make_plan
from jaxspec.planner.refine import AHEAD, SEGMENT, Observation, Refinement, whole_rows
from jaxspec.planner.strategy import Prediction, Strategy

__all__ = ["AHEAD", "SEGMENT", "Observation", "Plan", "Prediction", "Refinement", "Strategy", "allowed_precisions",
           "make_plan", "tree_bytes", "whole_rows"]
