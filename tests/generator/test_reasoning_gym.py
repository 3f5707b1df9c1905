"""``dataset.kind: reasoning_gym`` and ``reward: reasoning_gym`` (issue 41, item 3) against reasoning-gym itself:
the examples are the task's items, the train and test seeds never share an item, the reward is the task's own
``score_answer`` on the ``<answer>`` the system prompt asks for, and a missing package or a wrong task is a
config error saying what to do."""

import json
import sys
from pathlib import Path

import pytest
import reasoning_gym
from transformers import AutoTokenizer

from generator.datasets import (
    REASONING_GYM_SYSTEM_PROMPT,
    DatasetError,
    PromptStream,
    load_examples,
    render_example,
)
from generator.rewards import RewardSet
from shared.config.schema import DatasetConfig, GRPOConfig
from shared.config.schema.generator import RewardSpec
from shared.errors import UsageError


def dataset(**args) -> DatasetConfig:
    return DatasetConfig(kind="reasoning_gym", args=args)


def items(task: str, seed: int, size: int, **settings) -> list[dict]:
    return list(reasoning_gym.create_dataset(task, seed=seed, size=size, **settings))


def test_the_examples_are_the_tasks_items_with_their_answers_and_settings():
    settings = {"min_word_len": 3, "max_word_len": 4}
    examples = load_examples(dataset(task="spell_backward", size=6, seed=3, config=settings), seed=99)
    expected = items("spell_backward", 3, 6, **settings)
    assert [e.question for e in examples] == [i["question"] for i in expected]
    assert [e.data["answer"] for e in examples] == [i["answer"] for i in expected]
    assert all(3 <= len(e.data["metadata"]["word"]) <= 4 for e in examples)   # the settings reached the task
    assert [e.example_id for e in examples] == [f"rg:spell_backward:3+{i}" for i in range(6)]
    assert examples[0].data["reasoning_gym_config"] == settings
    # the run seed (99 above) plays no part: the args' seed decides
    assert [e.question for e in load_examples(dataset(task="spell_backward", size=6, seed=3, config=settings), 0)] \
        == [e.question for e in examples]


def test_a_weighted_mix_draws_each_task_with_its_own_settings():
    args = {"task": {"leg_counting": 3, "letter_counting": 1}, "size": 40, "seed": 7,
            "config": {"leg_counting": {"min_animals": 1, "max_animals": 2}}}
    examples = load_examples(dataset(**args), seed=0)
    tasks = [e.data["metadata"]["source_dataset"] for e in examples]
    assert set(tasks) == {"leg_counting", "letter_counting"} and tasks.count("leg_counting") > tasks.count(
        "letter_counting")
    legs = [e for e in examples if e.data["metadata"]["source_dataset"] == "leg_counting"]
    assert all(e.data["metadata"]["num_animals"] <= 2 for e in legs)
    assert legs[0].data["reasoning_gym_config"] == {"min_animals": 1, "max_animals": 2}
    # the same items reasoning-gym's composite gives for these weights and seed
    specs = [reasoning_gym.composite.DatasetSpec("leg_counting", 3, {"min_animals": 1, "max_animals": 2}),
             reasoning_gym.composite.DatasetSpec("letter_counting", 1, {})]
    composite = reasoning_gym.create_dataset("composite", datasets=specs, seed=7, size=40)
    assert [e.question for e in examples] == [item["question"] for item in composite]


def test_train_and_test_seeds_never_share_an_item():
    from generator.evaluate import eval_dataset

    config = GRPOConfig.model_validate({"generator": {"dataset": {
        "kind": "reasoning_gym", "args": {"task": "leg_counting", "size": 30, "seed": 5, "eval_size": 10}}}})
    training = load_examples(config.generator.dataset, config.seed)
    held_out = load_examples(eval_dataset(config), config.seed + 1)
    assert [e.question for e in held_out] == [i["question"] for i in items("leg_counting", 35, 10)]   # seed + size
    drawn = {e.example_id for e in PromptStream(training, seed=0, generator_id="g").take(90)}
    assert len(drawn) == 30 and not drawn & {e.example_id for e in held_out}
    assert not {e.question for e in training} & {e.question for e in held_out}
    # why ranges, not seeds, are compared: seed 6 is seed 5 shifted by one item
    assert [i["question"] for i in items("leg_counting", 6, 29)] == [i["question"] for i in items("leg_counting", 5,
                                                                                                  30)][1:]


@pytest.mark.parametrize("eval_seed", [5, 6, 34, 0])
def test_overlapping_seed_ranges_are_refused_at_load(eval_seed):
    with pytest.raises(ValueError, match=rf"eval_seed {eval_seed}: the held-out seeds \[{eval_seed}, {eval_seed + 10}\) "
                                         r"overlap the training seeds \[5, 35\)"):
        dataset(task="leg_counting", size=30, seed=5, eval_seed=eval_seed, eval_size=10)
    # just outside on either side loads
    dataset(task="leg_counting", size=30, seed=5, eval_seed=35, eval_size=10)
    dataset(task="leg_counting", size=30, seed=15, eval_seed=5, eval_size=10)


@pytest.mark.parametrize(("settings", "message"), [
    ({"args": {"task": "leg_counting", "sz": 3}}, "args.sz: Extra inputs are not permitted"),
    ({"args": {"task": ["leg_counting", "leg_counting"]}}, "task lists a name twice"),
    ({"args": {"task": {"leg_counting": 0}}}, "task 'leg_counting' has weight 0.0; a weight is > 0"),
    ({"args": {"task": "composite"}}, "name a procedural task"),
    ({"args": {"task": "leg_counting", "config": {"seed": 1}}}, r"config of 'leg_counting' sets \['seed'\]"),
    ({"args": {"task": ["leg_counting", "gcd"], "config": {"lcm": {}}}}, "'lcm' is not one of its tasks"),
    ({"args": {"task": "leg_counting"}, "split": "validation"}, "has the splits \\['train', 'test'\\], not "
                                                                  "'validation'"),
    ({"kind": "arithmetic", "args": {"task": "leg_counting"}}, "args apply to dataset kind 'reasoning_gym' only"),
])
def test_bad_args_are_config_errors_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig.model_validate({"kind": "reasoning_gym", **settings})


def test_an_unknown_task_or_setting_is_named_with_close_names():
    from deploy.preflight import dataset_problems

    config = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "reasoning_gym",
                                                                  "args": {"task": "leg_count"}}}})
    assert dataset_problems(config) == [
        "generator.dataset: generator.dataset.args.task: 'leg_count' is no reasoning-gym task; close names: "
        "leg_counting, rectangle_count, letter_counting, figlet_font"]
    with pytest.raises(DatasetError, match=r"args.config: reasoning-gym task 'gcd' refuses its settings "
                                           r'\{"bogus": 1\}: TypeError: .*bogus'):
        load_examples(dataset(task=["leg_counting", "gcd"], config={"gcd": {"bogus": 1}}), 0)


def reward_of(completions: list[str], example) -> list[float]:
    rewards = RewardSet.from_specs([RewardSpec(name="reasoning_gym")])
    return rewards.score_group(example.question, completions, example.data).components["reasoning_gym"]


def test_the_reward_scores_right_wrong_and_malformed_answers_of_leg_counting():
    example = load_examples(dataset(task="leg_counting", size=1, seed=5), 0)[0]
    assert example.data["answer"] == "184"   # 3 butterflies, 2 crabs, 6 sea slugs, 8 mantises, 14 giraffes, ...
    scores = reward_of(["<think>6*3+2*10+...</think><answer>184</answer>", "<answer> 184 </answer>",
                        "<answer>183</answer>", "<answer>184</answer> no, <answer>190</answer>",   # the last one counts
                        "184", "<answer>184", ""], example)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # tag null: the whole completion, stripped, is the answer (the task's own partial credit: len(oracle)/len(answer)
    # when the answer contains the oracle)
    whole = RewardSet.from_specs([RewardSpec(name="reasoning_gym", args={"tag": None})])
    assert whole.score_group(example.question, [" 184\n", "<answer>184</answer>", "184 legs", "  "],
                             example.data).components["reasoning_gym"] == pytest.approx([1.0, 3 / 20, 3 / 8, 0.0])


def test_the_reward_scores_right_wrong_and_malformed_answers_of_spell_backward():
    example = load_examples(dataset(task="spell_backward", size=1, seed=5), 0)[0]
    word = example.data["metadata"]["word"]
    assert example.data["answer"] == word[::-1] == "gnisucxe"
    scores = reward_of([f"<answer>{word[::-1]}</answer>", f"<answer>{word}</answer>", "<answer>gnisucxee</answer>",
                        f"<ANSWER>{word[::-1]}</ANSWER>"], example)
    # the task's own partial credit for a near miss (reasoning-gym's score_answer), none for a wrong tag
    near = reasoning_gym.create_dataset("spell_backward").score_answer("gnisucxee", {"answer": "gnisucxe",
                                                                                     "metadata": {}})
    assert scores == [1.0, 0.0, near, 0.0] and 0 < near < 1


def test_the_reward_on_an_example_that_is_no_reasoning_gym_item_fails_naming_why():
    from deploy.preflight import dataset_problems
    rewards = RewardSet.from_specs([RewardSpec(name="reasoning_gym", on_error=-1.0)])
    scored = rewards.score_group("What is 3 plus 4?", ["<answer>7</answer>"], {"answer": "7"})
    assert scored.components["reasoning_gym"] == [-1.0]   # on_error: it raised, naming why
    assert "ValueError: the example is no reasoning-gym item (an answer, and metadata naming its source_dataset; fields: ['answer'])" in scored.failures["reasoning_gym"][0].what
    config = GRPOConfig.model_validate({"generator": {"rewards": [{"name": "reasoning_gym"}]}})
    assert dataset_problems(config)[0].startswith(
        "generator.rewards[0] (reasoning_gym): arith:")
    assert "the reasoning_gym reward scores generator.dataset.kind reasoning_gym" in dataset_problems(config)[0]


def test_the_prompt_asks_for_the_answer_in_the_tags_the_reward_reads(tiny_model_dir, tmp_path):
    from generator.datasets import system_prompt_for

    assert REASONING_GYM_SYSTEM_PROMPT == reasoning_gym.utils.SYSTEM_PROMPTS["default"]
    cfg = dataset(task="leg_counting", size=1, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    example = load_examples(cfg, 0)[0]
    assert render_example(tokenizer, example, system_prompt_for(cfg)) == (
        f"[system]{REASONING_GYM_SYSTEM_PROMPT}[user]{example.question}[assistant]")
    assert system_prompt_for(cfg.model_copy(update={"system_prompt": ""})) is None


@pytest.fixture
def without_reasoning_gym(monkeypatch):
    """The package made to fail to import, as on a machine without the extra."""
    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)


INSTALL = "pip install 'grpo-stack[reasoning-gym]' (or pip install reasoning-gym==0.1.25)"


def test_without_the_package_check_config_and_the_generator_say_what_to_install(without_reasoning_gym, tmp_path):
    from deploy.preflight import dataset_problems, reward_problems
    from generator.main import run_generator

    config = GRPOConfig.model_validate({"generator": {
        "model": str(tmp_path / "no-model"), "hub_url": "http://127.0.0.1:9",
        "dataset": {"kind": "reasoning_gym", "args": {"task": "leg_counting"}},
        "rewards": [{"name": "reasoning_gym"}]}})   # the config itself loads: a learner host needs no reasoning-gym
    [dataset_problem] = dataset_problems(config)
    assert dataset_problem.startswith("generator.dataset: generator.dataset.kind 'reasoning_gym' needs the "
                                      "reasoning-gym package, which is not installed here")
    assert dataset_problem.endswith(INSTALL)
    [reward_problem] = reward_problems(config)
    assert reward_problem.startswith("generator.rewards[0] (reasoning_gym): reward 'reasoning_gym' needs the "
                                     "reasoning-gym package") and reward_problem.endswith(INSTALL)
    with pytest.raises(UsageError) as refused:
        run_generator(config)   # before any model loads or the hub is asked
    assert str(refused.value) == reward_problem


def accepts_held_out_items(prompt, completion, example):
    """1.0 when the example is item source_index of seed 1000 (the eval seed of the test below)."""
    index = example["metadata"]["source_index"]
    return float(prompt == reasoning_gym.create_dataset("leg_counting", seed=1000, size=index + 1)[index]["question"])


@pytest.mark.slow  # one `grpo eval` process of the tiny model
def test_grpo_eval_on_a_reasoning_gym_task(tiny_model_dir, tmp_path):
    from tests import service_forks as forks
    from tests.generator.test_evaluate import GRPO

    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "generator": {"dataset": {"kind": "reasoning_gym", "system_prompt": "",
                                  "args": {"task": "leg_counting", "size": 1000, "seed": 0, "eval_size": 3}},
                      "sampling": {"max_tokens": 4},
                      "rewards": [{"name": "reasoning_gym"},
                                  {"name": "python", "args": {
                                      "function": f"{Path(__file__).resolve()}:accepts_held_out_items"}}]},
        "eval": {"k": 1, "engine": "transformers", "num_examples": 5}}))
    done = forks.run([GRPO, "eval", "--model", str(tiny_model_dir), "--config", str(config)], capture_output=True,
                     text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["evaluated"] == "3 examples of reasoning-gym leg_counting, split 'test' (seeds from 1000)"
    assert result["num_examples"] == 3
    # the untrained tiny model gives no <answer>: 0 from the task's scorer; every example was a held-out item
    assert result["greedy_rewards"] == {"reasoning_gym": 0.0, "python": 1.0}
