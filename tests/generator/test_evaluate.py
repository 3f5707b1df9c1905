import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from generator.datasets import arithmetic_examples
from generator.engines.hf import TransformersEngine
from generator.evaluate import evaluate, generate_in_chunks, pass_at_k
from generator.tasks.arithmetic import ArithmeticTask
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.protocol.records import SamplingParams
from tests import service_forks as forks
from tests.live_server import LiveServer, make_config

GRPO = str(Path(sys.executable).parent / "grpo")


def test_pass_at_k_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)


def even_length(prompt, completion, example):
    return 1.0 if len(completion) % 2 == 0 else 0.0


def test_greedy_accuracy_matches_an_independent_count(tiny_model_dir):
    config = GRPOConfig.model_validate({
        "generator": {"rewards": [{"name": "python", "args": {"function": "tests.generator.test_evaluate:even_length"}},
                                  {"name": "arithmetic"}], "sampling": {"max_tokens": 6}},
        "eval": {"num_examples": 12, "k": 3, "engine": "transformers"}})
    result = evaluate(config, str(tiny_model_dir))
    assert result.num_examples == 12 and result.accuracy_reward == "python" and result.k == 3
    engine = TransformersEngine(tiny_model_dir)
    examples = arithmetic_examples(ArithmeticTask(), "test", 12, seed=1)
    prompts = [engine.tokenizer(e.question)["input_ids"] for e in examples]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), 1)
    texts = [engine.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in greedy]
    assert result.greedy_accuracy == pytest.approx(sum(len(t) % 2 == 0 for t in texts) / 12)
    assert 0.0 <= result.pass_at_k <= 1.0 and result.greedy_rewards["arithmetic"] == 0.0  # untrained model


def test_eval_rejects_an_unknown_accuracy_reward(tiny_model_dir):
    config = GRPOConfig.model_validate({"eval": {"accuracy_reward": "bleu", "num_examples": 2}})
    with pytest.raises(UsageError, match="not one of the generator's rewards"):
        evaluate(config, str(tiny_model_dir))


@pytest.mark.slow
def test_logprobs_command_queries_a_running_server(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        result = forks.run([GRPO, "logprobs", "--server", live.url, "--input-ids", "5", "6", "7", "8",
                                 "--prompt-length", "2"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)["logprobs"][0]) == 2
        bad = forks.run([GRPO, "logprobs", "--server", live.url, "--input-ids", "5", "-6",
                              "--prompt-length", "1"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "token id -6" in bad.stderr and "Traceback" not in bad.stderr


def test_chunked_generation_reports_progress_and_samples_what_one_call_samples(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir, max_batch_sequences=7)  # 3 samples each: chunks of 2 prompts
    prompts = [engine.tokenizer(e.question)["input_ids"]
               for e in arithmetic_examples(ArithmeticTask(), "test", 5, seed=1)]
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    reported = []
    chunked = generate_in_chunks(engine, prompts, sampling, 3, 7, reported.append)
    whole = engine.generate(prompts, sampling, 3, seed=7)
    assert reported == [6, 12, 15]
    assert [[c.token_ids for c in g] for g in chunked] == [[c.token_ids for c in g] for g in whole]
    other_seed = engine.generate(prompts, sampling, 3, seed=8)
    assert [[c.token_ids for c in g] for g in other_seed] != [[c.token_ids for c in g] for g in whole]


def test_evaluation_says_how_far_it_is(tiny_model_dir, caplog):
    config = GRPOConfig.model_validate({"generator": {"sampling": {"max_tokens": 4}},
                                        "eval": {"num_examples": 3, "k": 2, "engine": "transformers"}})
    with caplog.at_level(logging.INFO, logger="grpo.eval"):
        evaluate(config, str(tiny_model_dir))
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.eval"]
    assert lines[-1].startswith(f"evaluating {tiny_model_dir} on 3 examples of the arithmetic task's 'test' split: "
                                "9/9 sequences (100%), in ")


def final_after_result(prompt, completion, example):
    """The calculator model's answer: the text after the last observation is the reference."""
    return 1.0 if completion.rsplit("</result>", 1)[-1].strip() == example["answer"] else 0.0


@pytest.mark.slow  # three greedy/sampled multi-turn passes of the calculator model (~10-25 s on a busy CPU)
def test_eval_with_the_calculator_counts_tool_calls_and_scores_whole_trajectories(calc_model_dir, tmp_path):
    from generator.multiturn import MultiTurnRollouts
    from generator.rewards import RewardSet
    from shared.config.schema.generator import EnvironmentConfig
    from tests.calc_model import PROBLEMS

    questions = [f"{e}=" for e in PROBLEMS] + ["6*7="]   # memorised (calls the calculator) and not
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": str(eval(q[:-1]))}) + "\n" for q in questions))
    config = GRPOConfig.model_validate({
        "generator": {"dataset": {"kind": "jsonl", "path": str(data), "system_prompt": ""},
                      "rewards": [{"name": "python", "args": {
                          "function": "tests.generator.test_evaluate:final_after_result"}}],
                      "sampling": {"max_tokens": 24},
                      "environment": {"name": "calculator", "max_turns": 3}},
        "eval": {"num_examples": len(questions), "k": 1, "engine": "transformers", "path": str(data)}})
    result = evaluate(config, str(calc_model_dir))
    # an independent count: the same greedy trajectories, scored by the arithmetic reward on their text
    engine = TransformersEngine(calc_model_dir)
    runner = MultiTurnRollouts(engine, engine.tokenizer, EnvironmentConfig(name="calculator", max_turns=3))
    prompts = [engine.tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    _, groups = runner.generate([{"question": q} for q in questions], prompts,
                                SamplingParams(temperature=0.0, max_tokens=24), 1)
    texts = [engine.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in groups]
    rewards = RewardSet.from_specs(config.generator.rewards)
    right = [rewards.score_group(q, [t], {"answer": str(eval(q[:-1]))}).components["python"][0] >= 1
             for q, t in zip(questions, texts)]
    called = [0 in g[0].mask for g in groups]
    assert all(right[:4]) and all(called[:4])   # the memorised problems go through the calculator and are right
    assert result.num_examples == len(questions) and result.env_errors == 0
    assert result.greedy_accuracy == pytest.approx(sum(right) / len(questions))
    assert result.tool_call_rate == pytest.approx(sum(called) / len(questions))
    assert result.turns_per_trajectory == pytest.approx(runner.stats.turns / len(questions)) and result.turns_per_trajectory >= 4 * 2 / len(questions)
    assert {"tool_call_rate", "turns_per_trajectory", "env_errors"} <= set(result.as_dict())
    assert "tool_call_rate" not in replace(result, tool_call_rate=None).as_dict()  # single-turn results: absent
    assert result.evaluated == f"the first {len(questions)} examples of {data} (the training file)"


def write_jsonl(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": str(eval(q[:-1]))}) + "\n" for q in questions))
    return path


@pytest.mark.slow  # two `grpo eval` processes of the tiny model
def test_eval_on_a_jsonl_dataset_takes_an_eval_file_and_says_what_it_evaluates(tiny_model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ["1+1=", "2+2=", "3+3=", "4+4="])
    held_out = write_jsonl(tmp_path / "eval.jsonl", ["5+5=", "6+6=", "7+7="])
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"generator": {"dataset": {"kind": "jsonl", "path": str(train)},
                                                "rewards": [{"name": "arithmetic"}], "sampling": {"max_tokens": 4}},
                                  "eval": {"k": 1, "engine": "transformers"}}))
    base = [GRPO, "eval", "--model", str(tiny_model_dir), "--config", str(config)]
    # no eval file: refused before any model loads, naming the key, never the training lines as "test examples"
    refused = forks.run(base, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert f"generator.dataset is the jsonl source {train}, which has no held-out split: set eval.path" in refused.stderr
    assert refused.stdout == ""
    done = forks.run([*base, "--path", str(held_out), "--num-examples", "10"], capture_output=True, text=True,
                     timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["num_examples"] == 3 and result["evaluated"] == f"the first 3 examples of {held_out}"
    assert f"evaluating {tiny_model_dir} on the first 3 examples of {held_out}: " in done.stderr
    assert "test examples" not in done.stderr


def test_eval_path_is_checked_against_the_dataset_kind(tmp_path):
    from generator.evaluate import eval_dataset

    arithmetic = GRPOConfig.model_validate({"eval": {"path": str(tmp_path / "x.jsonl")}})
    with pytest.raises(UsageError, match="eval.path applies to generator.dataset.kind hf or jsonl, not 'arithmetic'"):
        eval_dataset(arithmetic)
    train = write_jsonl(tmp_path / "train.jsonl", ["1+1="])
    missing = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "jsonl", "path": str(train)}},
                                         "eval": {"path": str(tmp_path / "nope.jsonl")}})
    with pytest.raises(UsageError, match=f"eval.path {tmp_path / 'nope.jsonl'} is not a file"):
        eval_dataset(missing)
    hf = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": "gsm8k", "subset": "main"}},
                                    "eval": {"path": "my/gsm8k-eval", "split": "validation"}})
    assert (eval_dataset(hf).path, eval_dataset(hf).split, eval_dataset(hf).subset) == (
        "my/gsm8k-eval", "validation", "main")
