"""grpo_stack.train()'s inputs, checked before any service starts: the config it builds, the datasets it writes,
and the clear errors for what cannot work (tests/e2e/test_python_api.py runs it)."""

import json

import datasets
import pytest

from grpo_stack import train
from grpo_stack.api import config_tree, place_datasets, with_overrides
from grpo_stack.inputs import REGISTERED, SPEC_PREFIX, UnreachableReward, reward_specs, write_dataset
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.user_code import load_object
from tests.e2e.test_run import free_port


def score(prompt, completion, example):
    return float(completion == example["answer"])


def test_a_callable_reward_is_named_in_the_config_and_loads_as_the_generator_loads_it():
    specs = reward_specs([score, {"name": "format", "weight": 0.1}, score])
    assert [s.get("label") for s in specs] == ["score", None, "score_2"]
    assert specs[1] == {"name": "format", "weight": 0.1}
    function = specs[0]["args"]["function"]
    assert function.startswith(SPEC_PREFIX) and specs[2]["args"]["function"] != function
    assert load_object(function, "key") is score      # shared/user_code.py: what the python reward imports


def test_a_reward_registered_in_another_process_is_a_clear_error_naming_the_way_out():
    with pytest.raises(UnreachableReward, match="another process.*name the function in the config instead"):
        load_object(SPEC_PREFIX + "score_999", "function")
    with pytest.raises(UsageError, match=r"reward_funcs\[1\]: expected a callable or a reward entry"):
        reward_specs([score, "my_reward.py:score"])
    assert not hasattr(type(REGISTERED), "score_999")


def test_callables_with_generators_that_are_not_forked_are_refused_before_anything_starts(tmp_path):
    config = {"run": {"run_dir": str(tmp_path / "run"), "fork_services": False}}
    with pytest.raises(UsageError, match="reward_funcs: Python callables reach generators forked from this process "
                       r"only .*run.fork_services false.*'my_rewards.py:score'"):
        train(config, reward_funcs=score)
    config = {"run": {"run_dir": str(tmp_path / "run"), "placement": {"generators": [[0]]}}}
    with pytest.raises(UsageError, match="GPU placement"):
        train(config, reward_funcs=[score])


def test_a_callable_of_the_wrong_signature_stops_the_run_at_its_checks(tmp_path, tiny_model_dir):
    def two_args(prompt, completion):
        return 0.0

    with pytest.raises(UsageError, match=r"two_args\(prompt, completion\) cannot be called as fn\(prompt: str, "
                       r"completion: str, example: dict"):
        train({"run": {"run_dir": str(tmp_path / "run")}}, model=str(tiny_model_dir), reward_funcs=[two_args],
              ref_server__port=free_port())
    assert not (tmp_path / "run" / "logs").exists()     # nothing started


def test_config_sources_overrides_and_the_default_run_folder(tmp_path):
    (tmp_path / "run.yaml").write_text("learner: {max_steps: 5}\n")
    tree, source = config_tree(tmp_path / "run.yaml")
    assert tree == {"learner": {"max_steps": 5}} and source == str(tmp_path / "run.yaml")
    given = {"learner": {"lr": 0.5}}
    tree = with_overrides(config_tree(given)[0], {"learner__max_steps": 7, "generator.sampling.stop": ["\n", "#"]})
    assert tree == {"learner": {"lr": 0.5, "max_steps": 7}, "generator": {"sampling": {"stop": ["\n", "#"]}}}
    assert given == {"learner": {"lr": 0.5}}                 # the caller's dict is left as it was
    # a GRPOConfig gives what was set, so the state paths still follow the run folder train() chooses
    tree, _ = config_tree(GRPOConfig.model_validate({"learner": {"lr": 0.25}}))
    assert tree == {"learner": {"lr": 0.25}}
    with pytest.raises(UsageError, match="config: expected a YAML path, a dict of sections or a GRPOConfig, got int"):
        config_tree(3)
    with pytest.raises(UsageError, match="config file nope.yaml does not exist"):
        config_tree("nope.yaml")


def test_datasets_are_written_into_the_run_folder_in_the_kind_the_config_reads(tmp_path):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+3=", "answer": "5"}]
    tree = {}
    place_datasets(tree, rows, datasets.Dataset.from_list(rows[:1]), tmp_path / "data")
    assert tree == {"generator": {"dataset": {"kind": "jsonl", "path": str(tmp_path / "data/train_dataset.jsonl")}},
                    "eval": {"path": str(tmp_path / "data/eval_dataset.jsonl")}}
    lines = (tmp_path / "data/train_dataset.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert json.loads((tmp_path / "data/eval_dataset.jsonl").read_text()) == rows[0]
    tree = {"generator": {"dataset": {"question_field": "q"}}}
    place_datasets(tree, datasets.Dataset.from_list(rows), rows[1:], tmp_path / "hf")
    assert tree["generator"]["dataset"] == {"question_field": "q", "kind": "hf", "path": str(tmp_path / "hf/train_dataset")}
    assert datasets.load_from_disk(tree["eval"]["path"]).to_list() == rows[1:]
    assert write_dataset(tmp_path / "data/train_dataset.jsonl", tmp_path, "x") == (
        "jsonl", str(tmp_path / "data/train_dataset.jsonl"))


@pytest.mark.parametrize(("data", "message"), [
    ([{"question": "a"}, "b"], r"train_dataset\[1\]: expected a dict"),
    ([], "train_dataset: the list is empty"),
    ([{"question": object()}], r"train_dataset\[0\]: cannot be written as JSON"),
    ({"question": "a"}, "train_dataset: expected a datasets.Dataset, a list of dicts or a path, got builtins.dict"),
    ("missing.jsonl", "train_dataset: no such file or folder missing.jsonl"),
])
def test_a_dataset_that_cannot_be_used_names_the_argument(tmp_path, data, message):
    with pytest.raises(UsageError, match=message):
        write_dataset(data, tmp_path, "train_dataset")


def test_a_split_must_be_chosen_and_an_eval_set_needs_a_dataset_training_set(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": "a"}])})
    with pytest.raises(UsageError, match=r"a DatasetDict holds several splits \(train\); pass one, e.g. "
                       r"dataset\['train'\]"):
        write_dataset(splits, tmp_path, "train_dataset")
    with pytest.raises(UsageError, match="eval_dataset: needs a training dataset of kind jsonl or hf"):
        place_datasets({}, None, [{"question": "a"}], tmp_path)


def test_a_written_dataset_is_what_the_generator_loads(tmp_path):
    """The training set as the generator and the checks before a run read it (generator/datasets.py), in both
    kinds: a Dataset saved to disk (hf) and a list of dicts (jsonl)."""
    from deploy.preflight import dataset_problems
    from generator.datasets import load_examples
    from grpo_stack.api import validate

    rows = [{"question": f"{a}+1=", "answer": str(a + 1), "level": a % 3} for a in range(5)]
    for data, kind in ((datasets.Dataset.from_list(rows), "hf"), (rows, "jsonl")):
        tree = {"run": {"run_dir": str(tmp_path / kind)}}
        place_datasets(tree, data, None, tmp_path / kind / "data")
        config = validate(tree, "<dict>")
        assert config.generator.dataset.kind == kind and dataset_problems(config) == []
        examples = load_examples(config.generator.dataset, config.seed)
        assert sorted((e.data["question"], e.data["level"]) for e in examples) == sorted(
            (r["question"], r["level"]) for r in rows)
