"""The rollout loop with step rewards (issue 23 item 2), through the transformers engine and the tiny model: the
uploaded group's step ends are the tokens holding each step's last character (an independent oracle from the
character tokenizer's per-token lengths), the outcome joins per ``generator.step_rewards``, outcome-only groups
carry nothing, dynamic sampling looks at step rewards too. No hub: ``build_group`` is what ``upload`` sends (the
live-hub round trip is in test_loop.py)."""

import pytest

from generator.datasets import PromptStream, arithmetic_examples
from generator.engines.hf import TransformersEngine
from generator.loop import RolloutLoop, carries_signal
from generator.rewards import RewardSet, StepScores
from generator.tasks.arithmetic import ArithmeticTask
from shared.config.schema import RewardSpec
from shared.config.schema.generator import StepRewardsConfig
from shared.protocol.client import HubClient
from shared.protocol.records import SamplingParams

EVERY = 3


def every_third_char(prompt, completion, example):
    """A step every 3 characters and at the end; reward = the step's number (so steps differ)."""
    ends = sorted({*range(EVERY, len(completion), EVERY), len(completion)} - {0})
    return StepScores([float(j) for j in range(len(ends))], ends=ends)


def length_outcome(prompt, completion, example):
    return float(len(completion))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TransformersEngine(tiny_model_dir)


def make_loop(engine, tmp_path, specs, **kw):
    return RolloutLoop(
        engine=engine, tokenizer=engine.tokenizer, client=HubClient("http://127.0.0.1:9"),
        rewards=RewardSet.from_specs(specs),
        prompts=PromptStream(arithmetic_examples(ArithmeticTask(), "train", 50, seed=0), seed=0, generator_id="g"),
        sampling=SamplingParams(temperature=1.0, max_tokens=16), group_size=4, prompts_per_batch=2,
        generator_id="g", weights_dir=tmp_path / "w", wait_for_budget=False, **kw)


STEPS = RewardSpec(name="python", label="steps", weight=2.0,
                   args={"function": "tests.generator.test_loop_steps:every_third_char"})
OUTCOME = RewardSpec(name="python", label="length", weight=0.5,
                     args={"function": "tests.generator.test_loop_steps:length_outcome"})


def oracle_token_steps(tokenizer, ids, char_steps):
    """Per token, how many characters it adds to the decoded text (the char tokenizer decodes by concatenation;
    special tokens add none); a step ending at character c ends at the first token reaching c."""
    reached, total = [], 0
    for token in ids:
        total += len(tokenizer.decode([token], skip_special_tokens=True))
        reached.append(total)
    out = []
    for c, reward in char_steps:
        k = next(k for k, r in enumerate(reached) if r >= c)
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + reward)
        else:
            out.append((k, reward))
    return out


def group_steps(group):
    steps = [[] for _ in range(group.group_size)]
    for row, end, reward in zip(group.step_index.tolist(), group.step_end.tolist(), group.step_rewards.tolist()):
        steps[row].append((end, reward))
    return steps


@pytest.mark.parametrize("mode", ["final_step", "none"])
def test_built_groups_carry_the_mapped_steps(engine, tmp_path, mode):
    config = StepRewardsConfig(outcome=mode, outcome_weight=0.25)
    loop = make_loop(engine, tmp_path, [STEPS, OUTCOME], step_rewards=config)
    examples = loop.prompts.take(2)
    prompt_ids = [loop.encode_prompt(e) for e in examples]
    samples = engine.generate(prompt_ids, loop.sampling, loop.group_size, seed=3)
    tok = engine.tokenizer
    checked = 0
    for example, ids, group_samples in zip(examples, prompt_ids, samples):
        group = loop.build_group(example, ids, group_samples)
        group.validate()   # what the hub checks (ends inside the completion, increasing, finite)
        for i, (sample, got) in enumerate(zip(group_samples, group_steps(group))):
            text = tok.decode(sample.token_ids, skip_special_tokens=True)
            scored = every_third_char("", text, {}) if text else None
            expected = oracle_token_steps(tok, sample.token_ids, zip(scored.ends, [2.0 * r for r in scored.rewards])
                                          ) if scored else []
            outcome = 0.5 * len(text)
            assert float(group.rewards[i]) == pytest.approx(outcome)
            if mode == "final_step":
                last = len(sample.token_ids) - 1
                if expected and expected[-1][0] == last:
                    expected[-1] = (last, expected[-1][1] + 0.25 * outcome)
                else:
                    expected.append((last, 0.25 * outcome))
            assert [e for e, _ in got] == [e for e, _ in expected]
            assert [r for _, r in got] == pytest.approx([r for _, r in expected])
            checked += len(expected)
    assert checked > 8
    assert loop.stats.step_reward_errors == 0


def test_outcome_only_groups_carry_no_step_fields(engine, tmp_path):
    loop = make_loop(engine, tmp_path, [OUTCOME])
    groups = loop.step()
    assert groups and all(g.step_rewards is None and g.step_end is None for g in groups)


def test_carries_signal():
    assert carries_signal([1.0, 0.0], None)
    assert not carries_signal([1.0, 1.0], None)
    assert not carries_signal([1.0, 1.0], [[], []])                  # steps, but none
    assert not carries_signal([1.0, 1.0], [[(0, 0.5)], []])          # one step reward: nothing to normalise
    assert not carries_signal([1.0, 1.0], [[(0, 0.5)], [(2, 0.5)]])  # all equal, wherever they end
    assert carries_signal([1.0, 1.0], [[(0, 0.5), (3, 0.0)], []])    # two values, even within one completion
    assert carries_signal([0.0, 1.0], [[], []])


def constant_steps(prompt, completion, example):
    return StepScores([1.0], ends=[len(completion)]) if completion else 1.0


def test_dynamic_sampling_keeps_a_group_whose_outcomes_or_steps_differ(engine, tmp_path):
    none = StepRewardsConfig(outcome="none")
    constant = RewardSpec(name="python", args={"function": "tests.generator.test_loop_steps:constant_steps"})
    # outcome totals all 0 and every step reward 1: no signal anywhere, dropped
    loop = make_loop(engine, tmp_path, [constant], drop_constant_groups=True, step_rewards=none)
    assert loop.step() == [] and loop.stats.groups_dropped_constant == 2
    # outcome totals all 0, step rewards 0, 2, 4...: kept for its steps
    steps_only = make_loop(engine, tmp_path, [STEPS], drop_constant_groups=True, step_rewards=none)
    kept = steps_only.step()
    assert len(kept) == 2 and steps_only.stats.groups_dropped_constant == 0
    assert all(set(g.rewards.tolist()) == {0.0} and len(set(g.step_rewards.tolist())) > 1 for g in kept)


def test_the_closing_lines_give_the_mean_step_reward_and_no_outcome_mean_for_a_steps_only_reward(engine, tmp_path,
                                                                                                 caplog):
    """A reward that gives steps alone (a PRM) has no outcome: the summary said ``prm 0.0`` and never the step
    rewards, and the group carried the 0.0 as its component (the learner's reward/prm). Now it is no component: the
    per-reward means leave it out, and the mean of the step rewards uploaded is given, in the progress fields and
    the closing line (checked against the accepted groups' own step rewards)."""
    import logging

    import torch

    from generator.progress import Progress

    loop = make_loop(engine, tmp_path, [STEPS, OUTCOME], step_rewards=StepRewardsConfig(outcome="none"))
    groups = loop.step()
    for group in groups:
        loop._count(group, {"accepted": True, "queue_depth": 0})
    step_rewards = torch.cat([g.step_rewards for g in groups])
    lengths = torch.cat([g.rewards for g in groups]) / 0.5   # OUTCOME's weight: the total is 0.5 * length
    assert step_rewards.numel() > 8 and loop.stats.step_only_rewards == ["steps"]
    assert all(set(g.reward_components) == {"length"} for g in groups)
    assert loop.stats.mean_step_reward == pytest.approx(step_rewards.mean().item())
    caplog.set_level(logging.INFO, logger="grpo.generator")
    progress = Progress(enabled=True)
    assert progress.summary(loop.stats, 1)["step_reward"] == round(step_rewards.mean().item(), 3)
    progress.close(loop.stats, version=1)
    assert f"per-reward means {{'length': {round(lengths.mean().item(), 3)}}}" in caplog.text, caplog.text
    alone = make_loop(engine, tmp_path, [STEPS], step_rewards=StepRewardsConfig(outcome="none"))
    built = alone.step()   # each checked as the hub checks a group (build_group: validate)
    assert len(built) == 2 and all(g.reward_components == {} and g.step_rewards.numel() for g in built)
    assert (f"step rewards: {len(groups)} groups carried {step_rewards.numel()} steps "
            f"({step_rewards.numel() / len(groups):.2f} per group), mean step reward "
            f"{step_rewards.mean().item():.3f}; 0 completions") in caplog.text, caplog.text
