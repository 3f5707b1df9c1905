"""Held-out evaluation: greedy accuracy and pass@k, scored with the training rewards.

Training rollout rewards are not accuracy (they are sampled, on the training split, and may include shaping terms);
this evaluates a model folder on the evaluation split with greedy decoding and with k samples per example.

It says how far it is (logger ``grpo.eval``, a line every :data:`PROGRESS_EVERY_S` seconds with the percentage and
the time left): on a CPU the demo's 500 examples take a while.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from generator.datasets import render_prompt
from generator.main import build_engine, load_examples, system_prompt_for
from generator.rewards import RewardSet
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.progress import Ticker
from shared.protocol.records import SamplingParams

log = logging.getLogger("grpo.eval")

PROGRESS_EVERY_S = 5.0


@dataclass
class EvalResult:
    greedy_accuracy: float
    pass_at_k: float
    k: int
    num_examples: int
    greedy_mean_reward: float
    greedy_rewards: dict[str, float]
    accuracy_reward: str

    def as_dict(self) -> dict:
        return {"greedy_accuracy": self.greedy_accuracy, f"pass@{self.k}": self.pass_at_k, "k": self.k,
                "num_examples": self.num_examples, "greedy_mean_reward": self.greedy_mean_reward,
                "greedy_rewards": self.greedy_rewards, "accuracy_reward": self.accuracy_reward}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def generate_in_chunks(engine, prompts: list[list[int]], sampling: SamplingParams, n: int, seed: int | None,
                       progress: Callable[[int], object]) -> list:
    """``engine.generate(prompts, sampling, n, seed)``, with ``progress(sequences done)`` after each chunk.

    The transformers engine is called with the chunks it would cut itself (``max_batch_sequences // n`` prompts)
    and the seed on the first only: its random stream then runs on as in one call, so the samples are the same.
    An engine that seeds each request (vLLM) is called once."""
    size = getattr(engine, "max_batch_sequences", None)
    if size is None:
        results = engine.generate(prompts, sampling, n, seed=seed)
        progress(len(prompts) * n)
        return results
    per_call = max(1, size // max(n, 1))
    results: list = []
    for start in range(0, len(prompts), per_call):
        results += engine.generate(prompts[start:start + per_call], sampling, n, seed=seed if start == 0 else None)
        progress(len(results) * n)
    return results


def evaluate(config: GRPOConfig, model_dir: str) -> EvalResult:
    cfg, gen = config.eval, config.generator
    dataset = gen.dataset.model_copy(update={"split": cfg.split,
                                             "arithmetic_pool": min(gen.dataset.arithmetic_pool, cfg.num_examples)})
    examples = load_examples(dataset, seed=config.seed + 1)[:cfg.num_examples]
    rewards = RewardSet.from_specs(gen.rewards)
    names = [t.name for t in rewards.terms]
    judge = cfg.accuracy_reward or names[0]
    if judge not in names:
        raise UsageError(f"eval.accuracy_reward {judge!r} is not one of the generator's rewards {names}")
    engine_config = config.model_copy(update={"generator": gen.model_copy(update={"model": model_dir,
                                                                                  "engine": cfg.engine})})
    engine = build_engine(engine_config)
    try:
        tokenizer = engine.tokenizer
        system = system_prompt_for(gen.dataset)
        chat = gen.dataset.template is None and bool(getattr(tokenizer, "chat_template", None))
        prompts = [tokenizer(render_prompt(tokenizer, e.question, system, gen.dataset.template),
                             add_special_tokens=not chat)["input_ids"] for e in examples]
        ticker = Ticker(f"evaluating {model_dir} on {len(prompts)} {cfg.split} examples", len(prompts) * (1 + cfg.k),
                        log.info, every_s=PROGRESS_EVERY_S, unit="sequences")
        greedy = generate_in_chunks(engine, prompts, SamplingParams(temperature=0.0,
                                                                    max_tokens=gen.sampling.max_tokens), 1, None,
                                    lambda done: ticker.update(done, "greedy"))
        sampled = generate_in_chunks(engine, prompts, SamplingParams(
            temperature=cfg.temperature, top_p=gen.sampling.top_p, top_k=gen.sampling.top_k,
            max_tokens=gen.sampling.max_tokens), cfg.k, config.seed,
            lambda done: ticker.update(len(prompts) + done, f"pass@{cfg.k} samples"))
    finally:
        engine.close()
    correct = 0
    totals: dict[str, float] = dict.fromkeys(names, 0.0)
    total_reward = 0.0
    pass_sum = 0.0
    for example, g, s in zip(examples, greedy, sampled):
        texts = [tokenizer.decode(g[0].token_ids, skip_special_tokens=True)]
        scores = rewards.score_group(example.question, texts, example.data)
        correct += scores.components[judge][0] >= cfg.threshold
        total_reward += scores.total[0]
        for name in names:
            totals[name] += scores.components[name][0]
        sample_texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in s]
        sample_scores = rewards.score_group(example.question, sample_texts, example.data)
        hits = sum(v >= cfg.threshold for v in sample_scores.components[judge])
        pass_sum += pass_at_k(len(sample_texts), hits, cfg.k)
    n = len(examples)
    return EvalResult(correct / n, pass_sum / n, cfg.k, n, total_reward / n, {k: v / n for k, v in totals.items()},
                      judge)
