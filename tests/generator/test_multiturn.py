"""Multi-turn rollouts on the transformers engine (generator/multiturn.py) with a tiny model that calls the
calculator: the trajectory's tokens, mask and logprobs, and environment faults contained per trajectory."""

import time

import pytest
import torch

from generator.engines.hf import TransformersEngine
from generator.multiturn import MultiTurnRollouts
from shared.config.schema.generator import EnvironmentConfig
from shared.forward.logprobs import naive_sequence_logprobs
from shared.protocol.records import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
QUESTIONS = ["7*8=", "3*4=", "12*5=", "9*9="]
ANSWERS = {"7*8=": 56, "3*4=": 12, "12*5=": 60, "9*9=": 81}


@pytest.fixture(scope="module")
def engine(calc_model_dir):
    return TransformersEngine(calc_model_dir)


def encode(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def rollouts(engine, questions, n, cfg):
    runner = MultiTurnRollouts(engine, engine.tokenizer, cfg)
    prompts = [encode(engine, q) for q in questions]
    new_prompts, groups = runner.generate([{"question": q} for q in questions], prompts, GREEDY, n, seed=0)
    assert new_prompts == prompts  # the calculator's reset adds nothing
    return runner, prompts, groups


def test_calculator_trajectories_hold_the_observation_tokens_with_a_zero_mask(engine):
    runner, prompts, groups = rollouts(engine, QUESTIONS, 2, EnvironmentConfig(name="calculator"))
    eos = engine.tokenizer.eos_token_id
    for question, prompt, group in zip(QUESTIONS, prompts, groups):
        expression, value = question[:-1], ANSWERS[question]
        turn1, observation = encode(engine, f"<calc>{expression}</calc>"), encode(engine, f"<result>{value}</result>")
        turn2 = encode(engine, str(value)) + [eos]
        for sample in group:
            assert sample.token_ids == turn1 + observation + turn2
            assert sample.mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
            assert sample.finish_reason == "stop" and not sample.env_failed
            # environment tokens were never sampled: logprob 0; the model's are the policy's own, in context
            logprobs = torch.tensor(sample.logprobs)
            assert (logprobs[len(turn1):len(turn1) + len(observation)] == 0).all()
            with torch.no_grad():
                full = naive_sequence_logprobs(engine.model, torch.tensor([prompt + sample.token_ids]),
                                               torch.tensor([len(prompt)]), torch.tensor([len(sample.token_ids)]))[0]
            model = torch.tensor(sample.mask, dtype=torch.bool)
            torch.testing.assert_close(logprobs[model], full[model], atol=1e-4, rtol=0)
    stats = runner.stats
    assert (stats.trajectories, stats.turns, stats.env_calls, stats.env_errors) == (8, 16, 8, 0)
    assert stats.env_tokens == sum(len(s.mask) - sum(s.mask) for g in groups for s in g)


def test_limits_end_trajectories_with_length(engine):
    # one turn allowed: the model asked for the calculator, so the trajectory was cut ("length"), nothing appended
    _, _, groups = rollouts(engine, ["7*8="], 1, EnvironmentConfig(name="calculator", max_turns=1))
    assert groups[0][0].finish_reason == "length" and groups[0][0].mask == [1] * len("<calc>7*8</calc>")
    # 20 tokens in all: the observation does not fit after turn 1's 16 tokens
    _, _, groups = rollouts(engine, ["7*8="], 1, EnvironmentConfig(name="calculator", max_total_tokens=20))
    assert groups[0][0].finish_reason == "length" and len(groups[0][0].token_ids) == 16
    # a 5-token turn cap cuts turn 1
    _, _, groups = rollouts(engine, ["7*8="], 1, EnvironmentConfig(name="calculator", max_turn_tokens=5))
    assert groups[0][0].token_ids == encode(engine, "<calc") and groups[0][0].finish_reason == "length"


FAULTY = '''
import time

from generator.environments.calculator import Calculator


class Faulty(Calculator):
    def reset(self, sample):
        self.question = sample["question"]
        return None

    def step(self, text):
        if self.question == "3*4=":
            raise RuntimeError("the tool crashed")
        if self.question == "7*8=":
            time.sleep(20)
        if self.question == "12*5=":
            return "x" * 10_000_000
        return super().step(text)
'''


def test_environment_faults_fail_only_their_trajectories(engine, tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    cfg = EnvironmentConfig(name=f"{path}:Faulty", timeout_s=1.0)
    started = time.monotonic()
    runner, _, groups = rollouts(engine, QUESTIONS, 2, cfg)
    assert time.monotonic() - started < 15  # the hanging calls were abandoned after timeout_s
    turn1 = {q: encode(engine, f"<calc>{q[:-1]}</calc>") for q in QUESTIONS}
    for question, group in zip(QUESTIONS, groups):
        for sample in group:
            if question == "9*9=":  # the healthy one is untouched
                assert not sample.env_failed and sample.mask.count(0) == len(encode(engine, "<result>81</result>"))
            else:
                assert sample.env_failed and sample.token_ids == turn1[question] and sample.finish_reason == "stop"
    assert runner.stats.env_errors == 6 and runner.stats.trajectories == 8
