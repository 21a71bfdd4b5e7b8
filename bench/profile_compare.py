"""Two versions of the code side by side: medians and spreads of `bench/profile_step.py` runs.

    PYTHONPATH=. python3 bench/profile_compare.py DIR OUT.json

DIR holds profile_step JSONs named TAG_VERSION_rK.json (VERSION `old` or `new`, or another word
without underscores such as an XLA flag setting's name; K the repeat), made in one device call by
running profile_step for each version in turn, K = 1..3, so that all see the same machine. Per (tag,
method, draft weights, stage, version): wall ms per iteration of each run, their median, the median
GPU busy time and the kernels per iteration (nan for --no-trace runs). Writes OUT.json and prints
the table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

from bench import common

NAME = re.compile(r"(.+)_([^_]+)_r(\d+)\.json")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    runs = {}
    device = None
    for path in sorted(args.runs.glob("*.json")):
        match = NAME.fullmatch(path.name)
        if match is None:
            continue
        tag, version, _ = match.groups()
        data = json.loads(path.read_text())
        device = data["device"]
        for s in data["stages"]:
            per = s["iterations_per_call"]
            key = (tag, s["method"], s["draft_weights"], s["stage"], version)
            traced = [s.get(k, math.nan) / per for k in ("busy_ms", "kernels_per_call")]  # nan: --no-trace
            runs.setdefault(key, []).append((s["wall_ms"] / per, *traced))
    rows = [{"tag": k[0], "method": k[1], "draft_weights": k[2], "stage": k[3], "version": k[4],
             "wall_ms_runs": [r[0] for r in v], "wall_ms_median": statistics.median(r[0] for r in v),
             "busy_ms_median": statistics.median(r[1] for r in v), "kernels": v[0][2]} for k, v in sorted(runs.items())]
    common.write_json(args.out, {"device": device, "runs": rows})
    for r in rows:
        r["wall_runs"] = f"{r['wall_ms_median']:.2f} ({', '.join(f'{w:.2f}' for w in r['wall_ms_runs'])})"
    print(common.markdown_table(rows, [("run", "tag", "s"), ("method", "method", "s"), ("weights", "draft_weights", "s"),
                                       ("stage", "stage", "s"), ("version", "version", "s"),
                                       ("wall ms per iteration, median (runs)", "wall_runs", "s"),
                                       ("GPU busy ms median", "busy_ms_median", ".2f"), ("kernels", "kernels", ".0f")]))


if __name__ == "__main__":
    main()
