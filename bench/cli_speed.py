"""The CLI's decode speed for two or more source trees, measured in one call: `python -m
jaxspec.generate` as a user runs it, each (tree, method, batch) in its own process, the trees
alternating within every repeat so a drift of the GPU's rates falls on all of them alike.

    python3 bench/cli_speed.py --trees base=.base,new=. [--methods plain,vegas] [--batches 1,32]
        [--prompt-chars 4000] [--new 256] [--repeats 3] [--model smollm2] [--out bench/results] [--tag T]

A tree is a directory holding `jaxspec/` and `pallas_kernels/` (a checkout, or `git archive` of a
commit); it runs with <tree> first on PYTHONPATH. Prompts are the opening of local Python sources (a
different file per row, the same for every tree), sampled at T 0.7 / top-p 0.95 with seed = repeat.
The table gives each (method, batch) the median decode tokens/s of every tree (range in brackets)
and each tree's median over the first's. Writes OUT/cli_speed_<device><tag>.json after every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def prompt_files(directory: Path, count: int, chars: int) -> list[Path]:
    """`count` prompt files, each asking to continue the opening `chars` of one standard-library module."""
    sources = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > chars)
    paths = []
    for i, source in enumerate(sources[:count]):
        path = directory / f"prompt{i}.txt"
        text = source.read_text(errors="replace")[:chars]
        path.write_text(f"Continue this Python module from where it stops.\n\n{text}")
        paths.append(path)
    return paths


def generate(tree: Path, args, method: str, prompts: list[Path], seed: int) -> dict:
    """One `python -m jaxspec.generate --json` run of `tree`: its stats object."""
    command = [sys.executable, "-m", "jaxspec.generate", "--model", args.model, "--method", method, "--json",
               "--max-new-tokens", str(args.new), "--temperature", "0.7", "--top-p", "0.95", "--seed", str(seed),
               "--no-stream", "--no-progress"]
    for p in prompts:
        command += ["--prompt-file", str(p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"error: {tree} {method}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)["stats"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="name=dir,name=dir: the first is the basis")
    p.add_argument("--methods", default="plain,vegas")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-chars", type=int, default=4000)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    result = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "trees": trees, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompt_files(Path(tmp), max(batches), args.prompt_chars)
        for repeat in range(args.repeats):
            for batch in batches:
                for method in methods:
                    for name, tree in trees.items():
                        stats = generate(Path(tree), args, method, prompts[:batch], seed=repeat)
                        result["device"] = stats["device"]
                        result["runs"].append({"tree": name, "method": method, "batch": batch, "repeat": repeat,
                                               "decode_tokens_per_s": stats["decode_tokens_per_s"],
                                               "tokens_per_iteration": stats["tokens_per_iteration"],
                                               "prompt_tokens": stats["prompt_tokens"], "method_ran": stats["method"]})
                        print(name, method, batch, repeat, f"{stats['decode_tokens_per_s']:.0f} tok/s", flush=True)
                        args.out.mkdir(parents=True, exist_ok=True)
                        device = result["device"].lower().replace(" ", "_")
                        (args.out / f"cli_speed_{device}{args.tag}.json").write_text(json.dumps(result, indent=1))
    names = list(trees)
    print("| method | batch | " + " | ".join(f"{n} tok/s" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("|---" * (2 + 2 * len(names) - 1) + "|")
    for batch in batches:
        for method in methods:
            rates = {n: [r["decode_tokens_per_s"] for r in result["runs"] if (r["tree"], r["method"], r["batch"]) == (n, method, batch)]
                     for n in names}
            medians = {n: statistics.median(v) for n, v in rates.items()}
            cells = [f"{medians[n]:,.0f} [{min(rates[n]):,.0f}-{max(rates[n]):,.0f}]" for n in names]
            ratios = [f"{medians[n] / medians[names[0]]:.3f}" for n in names[1:]]
            print(f"| {method} | {batch} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
