"""verifiers environments (tests/generator/vf_test_envs.py, loaded by env_id) run as agents through the real endpoint
(uvicorn on 127.0.0.1, the transformers engine on tiny models): the rewards are the rubric's, the recorded tokens are
what the engine sampled, an environment that raises fails its episode only; the config's short form, the dataset
kind and check-config's messages."""

from __future__ import annotations

import signal
import sys

import pytest

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.config.schema.generator import DatasetConfig, GeneratorConfig
from shared.config.schema.verifiers import VerifiersConfig
from shared.errors import UsageError
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit
from tests.generator import test_agent_episodes as agent_tests
from tests.generator.test_agent_episodes import GREEDY, check_record

ENV_ID = "tests.generator.vf_test_envs"
# the agent tests' tiny models (a chat tokenizer; one memorised the calc tool episode)
tool_model_dir, untrained_dir = agent_tests.tool_model_dir, agent_tests.untrained_dir


def vf_env(kind: str, **args) -> dict:
    return {"name": "verifiers", "args": {"env_id": ENV_ID, "env_args": {"kind": kind, **args}}}


def episodes(model_dir, kind: str, n: int, sampling: SamplingParams, **env_args):
    """``n`` episodes of each row of the environment ``kind``: the engine (keeping what it sampled), the runner, the
    examples as the loop gives them, the group prompts and completions."""
    from generator.datasets import load_examples

    generator = GeneratorConfig.model_validate({"environment": vf_env(kind, **env_args)})
    examples = [{"question": e.question, **e.data} for e in load_examples(generator.dataset, seed=0)]
    engine = agent_kit.SpyEngine(TransformersEngine(model_dir))
    agent = AgentRollouts(engine, engine.tokenizer, generator.agent, sampling, seed=3)
    try:
        prompts, groups = agent.generate(examples, [[0]] * len(examples), sampling, n)
    finally:
        agent.close()
    return engine, agent, examples, prompts, groups


# -- config: the short form, conflicts ----------------------------------------------------------------------------
def test_environment_verifiers_is_an_agent_with_the_environments_rows_as_its_dataset():
    generator = GeneratorConfig.model_validate({"environment": {**vf_env("single"), "max_turns": 3, "on_error": -1},
                                                "agent": {"timeout_s": 9}})
    assert generator.environment is None and generator.rewards == []
    agent = generator.agent
    assert agent.verifiers == VerifiersConfig(env_id=ENV_ID, env_args={"kind": "single"})
    assert (agent.fn, agent.reward, agent.max_turns, agent.on_error, agent.timeout_s) == (None, "agent", 3, -1.0, 9.0)
    assert agent.name == f"verifiers environment {ENV_ID}"
    assert generator.dataset.kind == "verifiers" and generator.dataset.verifiers == agent.verifiers
    # a dataset of its own is kept; reward: rewards scores with generator.rewards
    own = GeneratorConfig.model_validate({"environment": {**vf_env("single"), "reward": "rewards"},
                                          "dataset": {"kind": "jsonl", "path": "x.jsonl"}})
    assert own.dataset.kind == "jsonl" and own.dataset.verifiers is None and own.agent.reward == "rewards"
    assert [r.name for r in own.rewards] == ["arithmetic"]
    # what a run writes out loads again as it is
    assert GeneratorConfig.model_validate(generator.model_dump()) == generator
    # sections given as config objects (the Python API) are kept as they were given
    objects = GeneratorConfig.model_validate({"environment": vf_env("single"), "agent": AgentConfig(timeout_s=9),
                                              "dataset": DatasetConfig(kind="jsonl", path="x.jsonl")})
    assert (objects.agent.timeout_s, objects.agent.verifiers, objects.dataset.kind) == (9.0, agent.verifiers, "jsonl")
    assert GeneratorConfig.model_validate({"agent": AgentConfig(verifiers=agent.verifiers)}).dataset == generator.dataset


@pytest.mark.parametrize(("section", "message"), [
    ({"environment": {**vf_env("single"), "stop": "</a>"}}, "generator.environment.stop does not apply"),
    ({"environment": {**vf_env("single"), "timeout_s": 3}}, "use generator.agent.timeout_s"),
    ({"environment": {"name": "verifiers", "args": {"env_args": {}}}}, "args.env_id is required"),
    ({"environment": vf_env("single"), "agent": "my_agent.py:fn"}, "generator.agent may only hold its endpoint"),
    ({"environment": vf_env("single"), "agent": {"fn": "a.py:f"}}, "generator.agent.fn (a.py:f) are both set"),
    ({"agent": {"fn": "a.py:f", "verifiers": {"env_id": "x"}}}, "are both set"),
    ({"dataset": {"kind": "verifiers"}}, "dataset kind 'verifiers' needs its environment"),
])
def test_a_verifiers_config_that_cannot_work_is_refused_naming_the_key(section, message):
    with pytest.raises(ValueError, match="generator|dataset kind") as caught:
        GeneratorConfig.model_validate(section)
    assert message in str(caught.value)


# -- check-config: the package missing, an env_id that does not import --------------------------------------------
@pytest.mark.slow
def test_check_config_names_an_env_id_that_does_not_import_and_a_missing_verifiers_package(monkeypatch):
    from deploy.preflight import agent_problems, dataset_problems
    from shared.config.schema import GRPOConfig

    def problems(env_id: str, env_args: dict, dataset: dict | None = None) -> list[str]:
        generator = {"environment": {"name": "verifiers", "args": {"env_id": env_id, "env_args": env_args}}}
        config = GRPOConfig.model_validate({"generator": {**generator, **({"dataset": dataset} if dataset else {})}})
        return dataset_problems(config) + agent_problems(config)

    # the environment's rows as the dataset: its check says it (once)
    (problem,) = problems("vf-no-such-env", {})
    assert problem.startswith("generator.dataset: generator.environment.args.env_id: cannot import the module "
                              "'vf_no_such_env' of verifiers environment 'vf-no-such-env' (ModuleNotFoundError")
    # a dataset of its own: the agent's check loads the environment
    rows = {"kind": "arithmetic"}
    (problem,) = problems(ENV_ID, {"kind": "nothing"}, rows)
    assert problem.startswith(f"generator.environment.args: verifiers environment '{ENV_ID}' did not load with "
                              'env_args {"kind": "nothing"}') and "unknown kind 'nothing'" in problem
    assert problems(ENV_ID, {"kind": "single"}, rows) == []
    monkeypatch.setitem(sys.modules, "verifiers.legacy", None)   # as if verifiers were not installed
    (problem,) = problems(ENV_ID, {"kind": "tools"}, rows)
    assert "needs the verifiers package: pip install 'grpo-stack[verifiers]'" in problem


# -- the dataset kind ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_environments_rows_are_the_examples_and_its_eval_dataset_the_eval_split():
    from generator.datasets import load_examples

    dataset = GeneratorConfig.model_validate({"environment": vf_env("single", rows=3)}).dataset
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    train = load_examples(dataset, seed=0)
    # verifiers' constructor installs its own SIGINT/SIGTERM handlers: the process's own are put back
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert [(e.question, e.data["answer"], e.prompt_messages) for e in train] == [
        (f"{i}+{i}", str(i), [{"role": "user", "content": f"{i}+{i}"}]) for i in range(3)]
    assert [e.example_id for e in train] == [f"verifiers:{ENV_ID}:train:{i}" for i in range(3)]
    held_out = load_examples(dataset.model_copy(update={"split": "eval"}), seed=0)
    assert [(e.question, e.data["answer"]) for e in held_out] == [("0*0", "0"), ("1*1", "1")]
    with pytest.raises(UsageError, match="has the splits 'train'"):
        load_examples(dataset.model_copy(update={"split": "validation"}), seed=0)


# -- episodes through the endpoint --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_single_turn_environments_rewards_are_its_rubrics_on_what_the_engine_sampled(untrained_dir):
    from tests.generator.vf_test_envs import checksum

    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    engine, agent, examples, prompts, groups = episodes(untrained_dir, "single", 2, sampling, rows=4)
    assert agent.stats.trajectories == 8 and agent.stats.agent_errors == 0 and agent.stats.turns == 8
    for example, prompt, group in zip(examples, prompts, groups):
        assert engine.tokenizer.decode(prompt).endswith(f"{example['question']}<|im_end|>\n<|im_start|>assistant\n")
        for completion in group:
            (turn,) = check_record(engine, prompt, completion)
            text = engine.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            assert completion.env_reward == pytest.approx(checksum(text) + float(example["answer"]))
    assert len({c.env_reward for group in groups for c in group}) > 4   # the checksum saw different answers


@pytest.mark.slow
def test_a_tool_environments_two_tool_calls_are_recorded_token_for_token_and_rewarded(tool_model_dir):
    engine, agent, _, prompts, groups = episodes(tool_model_dir, "tools", 1, GREEDY)
    (completion,) = groups[0]
    assert len(check_record(engine, prompts[0], completion)) == 3
    assert completion.env_reward == 1.0 and completion.env_failure is None
    # the episode is the template's rendering of the memorised conversation: the tool results the environment
    # computed are the non-model tokens, and nothing was rendered otherwise
    rendered = engine.tokenizer.apply_chat_template(agent_kit.script_messages(), tools=agent_kit.TOOLS, tokenize=False)
    assert engine.tokenizer.decode(prompts[0] + completion.token_ids, skip_special_tokens=False) == rendered.rstrip()
    assert agent.stats.template_mismatches == 0 and agent.stats.turns == 3 and agent.stats.env_calls == 2


@pytest.mark.slow
def test_an_environment_that_raises_fails_its_episodes_only(untrained_dir):
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    engine, agent, examples, prompts, groups = episodes(untrained_dir, "raising", 2, sampling, rows=4)
    explodes = [example["info"]["explode"] for example in examples]
    assert explodes == [False, True, False, True]
    assert agent.stats.agent_errors == 4 and agent.stats.trajectories == 8
    for explode, prompt, group in zip(explodes, prompts, groups):
        for completion in group:
            if explode:   # its first turn is kept (sampled before the environment raised), rewarded on_error
                assert completion.env_failed and "the environment broke" in str(completion.env_failure)
                assert completion.env_reward is None and len(check_record(engine, prompt, completion)) == 1
            else:
                assert not completion.env_failed and completion.env_reward == 1.0
                assert len(check_record(engine, prompt, completion)) == 2


@pytest.mark.slow
def test_grpo_eval_runs_the_environment_on_its_eval_split_and_judges_by_its_rubric(untrained_dir):
    from generator.evaluate import evaluate
    from shared.config.schema import GRPOConfig
    from tests.generator.vf_test_envs import checksum

    config = GRPOConfig.model_validate({
        "generator": {"environment": vf_env("single", rows=3), "sampling": {"max_tokens": 8}},
        "eval": {"split": "eval", "num_examples": 2, "k": 2, "engine": "transformers", "threshold": 1.0}})
    result = evaluate(config, untrained_dir)
    # an independent count: the engine's greedy answer to each held-out row's chat prompt, scored by the rubric
    engine = TransformersEngine(untrained_dir)
    held_out = [("0*0", 0.0), ("1*1", 1.0)]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for q, _ in held_out]
    answers = [engine.tokenizer.decode(group[0].token_ids, skip_special_tokens=True)
               for group in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), 1)]
    rubric = [checksum(text) + answer for text, (_, answer) in zip(answers, held_out)]
    assert result.num_examples == 2 and result.accuracy_reward == "agent" and result.env_errors == 0
    assert result.greedy_mean_reward == pytest.approx(sum(rubric) / 2)
    assert result.greedy_accuracy == sum(r >= 1.0 for r in rubric) / 2 and result.turns_per_trajectory == 1.0
