"""bench/off_policy.py's seeded grid: cell names, the per-seed table (mean, standard error, the gap to the lowest
staleness) and the merge of grids split over several folders, on hand-made summaries (no grpo run)."""

import json
import math

import pytest
import yaml

from bench.off_policy import by_seed, cell_name, merge_summaries, read_summary


def cell(staleness, mode, seed, final):
    return {"staleness": staleness, "mode": mode, "seed": seed, "accuracy": {"5": 0.1, "10": final}}


def summary(*cells):
    return {"config": "c.yaml", "cells": {cell_name(c["staleness"], c["mode"], c["seed"]): c for c in cells}}


def rows(markdown):
    return {tuple(line.split(" | ")[:2]): line.strip("| ").split(" | ") for line in markdown.splitlines()[2:]}


def test_cell_names_carry_the_seed_only_when_seeds_are_given():
    assert cell_name(8, "token_tis") == "stale8-token_tis"
    assert cell_name(8, "token_tis", 0) == "stale8-token_tis-seed0"


def test_the_seed_table_has_the_mean_standard_error_and_gap_by_hand():
    finals = {0: [0.80, 0.70, 0.75], 8: [0.70, 0.72, 0.65]}
    grid = summary(*(cell(s, "token_tis", i, f) for s, values in finals.items() for i, f in enumerate(values)),
                   cell(8, "none", 0, 0.40))
    table = rows(by_seed(grid))
    s0, s8, none = table[("| 0", "`token_tis`")], table[("| 8", "`token_tis`")], table[("| 8", "`none`")]
    assert s0[2:5] == ["3", "80.0% / 70.0% / 75.0%", "75.0%"]
    # sample standard deviation 5 points over sqrt(3)
    assert s0[5] == f"{5 / math.sqrt(3):.1f} points" == "2.9 points"
    assert s0[6] == "-"
    assert s8[4] == "69.0%" and s8[6] == "-6.0 points"
    assert none[5] == "-" and none[6] == "-"  # one seed: no error; no `none` run at staleness 0: no gap


def test_a_run_without_an_accuracy_is_left_out_not_counted_as_zero():
    grid = summary(cell(0, "none", 0, 0.5), cell(0, "none", 1, None))
    assert rows(by_seed(grid))[("| 0", "`none`")][2:5] == ["1", "50.0%", "50.0%"]


def test_grids_from_several_folders_merge_and_a_seed_given_twice_is_refused():
    merged = merge_summaries([summary(cell(0, "none", 0, 0.5)), summary(cell(0, "none", 1, 0.7))])
    assert sorted(merged["cells"]) == ["stale0-none-seed0", "stale0-none-seed1"]
    with pytest.raises(SystemExit, match="stale0-none-seed0 is in two of the folders"):
        merge_summaries([summary(cell(0, "none", 0, 0.5)), summary(cell(0, "none", 0, 0.7))])


def test_an_older_summary_takes_each_cells_seed_from_its_runs_config(tmp_path):
    old = {"config": "c.yaml", "cells": {"stale8-token_tis": {"staleness": 8, "mode": "token_tis",
                                                             "accuracy": {"15": 0.69}}}}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    (tmp_path / "stale8-token_tis").mkdir()
    (tmp_path / "stale8-token_tis" / "bench-config.yaml").write_text(yaml.safe_dump({"seed": 2}))
    assert read_summary(tmp_path)["cells"]["stale8-token_tis"]["seed"] == 2


def test_a_folder_without_a_summary_is_named_in_the_error(tmp_path):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'summary.json'} does not exist"):
        read_summary(tmp_path)
