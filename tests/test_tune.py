"""`python -m jaxspec.tune` runs the tuning steps (draft trees included) and `generate --tuned` uses what it chose."""

from __future__ import annotations

import json

import pytest

from jaxspec import generate, tune
from jaxspec.decoding.spec import SpecConfig, at_batch, spec_from_settings


@pytest.fixture(scope="module")
def tuned_file(hf_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "tuned.json"
    tune.main([
        "--model", str(hf_checkpoints["llama"]), "--corpus", "2", "120", "--max-new-tokens", "6",
        "--methods", "plain,vegas,ngram", "--ratios", "0.05,0.3", "--gammas", "2,3", "--trees", "dfs:2,1",
        "--out", str(path),
    ])
    return path


def test_tune_writes_one_choice_per_method(tuned_file):
    result = json.loads(tuned_file.read_text())
    assert set(result["methods"]) == {"plain", "vegas", "ngram"}
    vegas = result["methods"]["vegas"]
    assert vegas["gamma"] in (2, 3) and vegas["ratio"] in (0.05, 0.3)
    assert result["methods"]["ngram"]["ratio"] is None
    steps = [m for m in result["measurements"] if m["method"] == "vegas"]
    # step 1: both ratios at the large gamma; step 2: both gammas; step 3: both ratios at the chosen gamma
    assert [m["gamma"] for m in steps[:2]] == [3, 3] and {m["gamma"] for m in steps[2:4]} == {2, 3}
    assert len(steps) == 7 and all(m["tokens_per_s"] > 0 and m["tokens_per_iteration"] >= 1 for m in steps)
    # step 4: the tree at the chain's ratio; the chosen row is the faster of the chain's choice and it
    tree_row = steps[6]
    assert (tree_row["tree"], tree_row["traversal"], tree_row["gamma"]) == ("2,1", "dfs", 2)
    assert vegas in steps and vegas["tokens_per_s"] >= tree_row["tokens_per_s"]
    ngram = [m for m in result["measurements"] if m["method"] == "ngram"]
    assert [m["tree"] for m in ngram] == [None, None, "2,1"]
    assert result["methods"]["ngram"] == max(ngram, key=lambda m: m["tokens_per_s"])


def test_generate_uses_the_tuned_choice(tuned_file, hf_checkpoints, capsys):
    choice = json.loads(tuned_file.read_text())["methods"]["vegas"]
    generate.main(["--model", str(hf_checkpoints["llama"]), "--prompt", "hello there", "--max-new-tokens", "4",
                   "--method", "vegas", "--tuned", str(tuned_file), "--json"])
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["gamma"] == choice["gamma"] and stats["ratio"] == choice["ratio"]
    generate.main(["--model", str(hf_checkpoints["llama"]), "--prompt", "hello there", "--max-new-tokens", "4",
                   "--method", "vegas", "--tuned", str(tuned_file), "--gamma", "5", "--json"])
    assert json.loads(capsys.readouterr().out)["stats"]["gamma"] == 5  # an explicit flag wins


def test_generate_takes_the_metric_of_a_hand_written_choice(hf_checkpoints, tmp_path, capsys):
    """bench/kv_bound.json's format: gamma, ratio and metric per method; an explicit --metric wins."""
    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps({"methods": {"vegas": {"gamma": 3, "ratio": 0.5, "metric": "logit"}}}))
    run = ["--model", str(hf_checkpoints["llama"]), "--prompt", "hello there", "--max-new-tokens", "4", "--method", "vegas",
           "--tuned", str(choice), "--json"]
    generate.main(run)
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["gamma"], stats["ratio"], stats["metric"]) == (3, 0.5, "logit")
    generate.main(run + ["--metric", "weight"])
    assert json.loads(capsys.readouterr().out)["stats"]["metric"] == "weight"


def test_generate_takes_a_tuned_tree(hf_checkpoints, tmp_path, capsys):
    """A tuned tree is drafted unless --gamma asks for a chain; --tree wins over both."""
    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps({"methods": {"vegas": {"gamma": 3, "ratio": 0.5, "tree": "2,2", "traversal": "dfs"}}}))
    run = ["--model", str(hf_checkpoints["llama"]), "--prompt", "hello there", "--max-new-tokens", "4", "--method", "vegas",
           "--tuned", str(choice), "--json"]
    generate.main(run)
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["tree"], stats["traversal"], stats["gamma"], stats["ratio"]) == ("2,2", "dfs", 2, 0.5)
    generate.main(run + ["--gamma", "3"])
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["tree"], stats["gamma"]) == (None, 3)
    generate.main(run + ["--tree", "3,1"])
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["tree"], stats["traversal"]) == ("3,1", "bfs")


def test_a_tuned_choice_per_batch():
    """Each batch takes the settings of the largest listed size not above it, over the method's own."""
    choice = {"gamma": 6, "ratio": 0.07, "select_every": 2,
              "batches": {"128": {"gamma": 10, "balance": 2.0}, "32": {"balance": 2.0}}}
    base = {"gamma": 6, "ratio": 0.07, "select_every": 2}
    for batch, want in ((1, base), (31, base), (32, base | {"balance": 2.0}), (127, base | {"balance": 2.0}),
                        (128, base | {"gamma": 10, "balance": 2.0}), (4096, base | {"gamma": 10, "balance": 2.0})):
        assert at_batch(choice, batch) == want, batch
    assert at_batch(base, 64) == base and "batches" in choice  # the choice itself is left as it was


def test_settings_given_win_over_tuned_ones_over_defaults():
    """spec_from_settings, the one builder: a given setting wins, then the tuned choice's (0 or null:
    unset; keys it does not know: ignored), then the default (SpecConfig's, eagle's own chain); the
    tuned tree brings its traversal and applies unless a gamma or a tree is given."""
    tuned = {"gamma": 3, "ratio": 0.5, "metric": "logit", "balance": None, "select_every": 0, "tree": "2,2",
             "traversal": "dfs", "tokens_per_s": 9.0}
    spec = spec_from_settings("vegas", tuned=tuned, traversal="bfs", group=None)
    assert (spec.tree, spec.traversal, spec.gamma, spec.ratio, spec.metric) == ((2, 2), "dfs", 2, 0.5, "logit")
    assert (spec.balance, spec.select_every, spec.group) == (1.0, 1, 0)
    chain = spec_from_settings("vegas", tuned=tuned, gamma=4, ratio=0.1, metric="weight", backend="pallas")
    assert (chain.tree, chain.traversal, chain.gamma, chain.ratio, chain.metric, chain.backend) == (None, "bfs", 4, 0.1, "weight", "pallas")
    assert spec_from_settings("vegas", tuned=tuned, tree=(3, 1)).tree == (3, 1)
    assert spec_from_settings() == SpecConfig().validate()
    assert spec_from_settings("eagle").gamma == 4 != SpecConfig().gamma  # eagle's own default chain
    assert spec_from_settings("eagle", gamma=6).gamma == 6 and spec_from_settings("eagle", tuned={"gamma": 3}).gamma == 3
    assert spec_from_settings("eagle", tree=(3, 2, 1)).gamma == 3


def test_generate_takes_the_tuned_settings_of_its_batch(hf_checkpoints, tmp_path, capsys):
    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps({"methods": {"vegas": {"gamma": 3, "ratio": 0.5,
                                                        "batches": {"2": {"gamma": 4, "balance": 2}}}}}))
    run = ["--model", str(hf_checkpoints["llama"]), "--prompt", "hello there", "--max-new-tokens", "4", "--method", "vegas",
           "--tuned", str(choice), "--json"]
    for extra, want in (([], (3, 0.5, 1.0)), (["--prompt", "the other row", "--gamma", "5"], (5, 0.5, 2.0))):  # a flag wins
        generate.main(run + extra)
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert (stats["gamma"], stats["ratio"], stats["balance"]) == want, extra


def test_tuned_file_errors(tuned_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # before any model loads
        tune.main(["--model", "/nonexistent/model", "--methods", "plain,eagle"])
    assert exit_info.value.code == 2 and "tune has no ratio or selection to tune for eagle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--method", "quest", "--tuned", str(tuned_file)])
    assert exit_info.value.code == 2 and "no entry for method 'quest'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    for text in (b"not json", bytes(range(256))):  # and bytes that are no text
        bad.write_bytes(text)
        with pytest.raises(SystemExit):
            generate.main(["--method", "vegas", "--tuned", str(bad)])
        assert "cannot read tuned file" in capsys.readouterr().err
    for args, fragment in ((["--prompt-file", str(tmp_path)], "cannot read prompt file"),
                           (["--corpus", "0", "0"], "--corpus N TOKENS of at least 1"),
                           (["--tolerance", "nan"], "--tolerance in [0, 1)")):
        with pytest.raises(SystemExit) as exit_info:
            tune.main(["--methods", "plain", *args])
        assert exit_info.value.code == 2 and fragment in capsys.readouterr().err
    for setting, fragment in (({"gamma": "six"}, "vegas.gamma must be an integer"), ({"select_every": 2.5}, "vegas.select_every"),
                              ({"ratio": True}, "vegas.ratio must be a number"), ([6], "must be an object"),
                              ({"batches": [128]}, "vegas.batches must be an object"),
                              ({"batches": {"0": {}}}, "batches keys are batch sizes"),
                              ({"batches": {"many": {}}}, "batches keys are batch sizes"),
                              ({"batches": {"\u00b2": {}}}, "batches keys are batch sizes"),
                              ({"batches": {"128": {"gamma": 10.5}}}, "vegas.batches.128.gamma must be an integer"),
                              ({"batches": {"128": 10}}, "must be an object")):
        bad.write_text(json.dumps({"methods": {"vegas": setting}}))
        with pytest.raises(SystemExit) as exit_info:
            generate.main(["--method", "vegas", "--tuned", str(bad)])
        assert exit_info.value.code == 2 and fragment in capsys.readouterr().err
