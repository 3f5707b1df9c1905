import threading
import time

import pytest
import requests
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.datasets import PromptStream, arithmetic_examples
from generator.engines.hf import TransformersEngine
from generator.loop import RolloutLoop
from generator.rewards import RewardSet
from generator.tasks.arithmetic import ArithmeticTask
from shared.config.schema import RewardSpec
from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.records import SamplingParams
from tests.live_server import LiveServer, make_config

pytestmark = pytest.mark.slow  # every test runs the loop against a live hub (LiveServer)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TransformersEngine(tiny_model_dir)


def make_loop(engine, url, tmp_path, generator_id="gen-a", rewards=None, retry_s=30.0, **kw):
    examples = arithmetic_examples(ArithmeticTask(), "train", 200, seed=0)
    return RolloutLoop(
        engine=engine, tokenizer=engine.tokenizer,
        client=HubClient(url, retry=RetryPolicy(max_retry_s=retry_s, initial_backoff_s=0.1, max_backoff_s=0.5)),
        rewards=rewards or RewardSet.from_specs([RewardSpec(name="arithmetic"), RewardSpec(name="format",
                                                                                          weight=0.1)]),
        prompts=PromptStream(examples, seed=0, generator_id=generator_id),
        sampling=SamplingParams(temperature=1.0, max_tokens=8), group_size=4, prompts_per_batch=2,
        generator_id=generator_id, weights_dir=tmp_path / f"w-{generator_id}", **kw)


def test_groups_reach_the_hub_with_provenance(engine, tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        loop = make_loop(engine, live.url, tmp_path)
        requests_sent = []
        send = loop.client._request
        loop.client._request = lambda method, path, **kw: requests_sent.append(path) or send(method, path, **kw)
        stats = loop.run(threading.Event(), max_groups=3)
        assert stats.groups_uploaded == 3 and stats.prompts == 4  # two engine calls of two prompts
        # one upload request per engine call (the second call's groups cut to the one still wanted)
        assert requests_sent.count("/v1/rollouts/batch") == 2 and "/v1/rollouts" not in requests_sent
        batch = HubClient(live.url).get_batch(3, wait_s=20)
    assert batch.batch_size == 12 and batch.policy_versions.tolist() == [0] * 12
    assert batch.temperature == 1.0 and set(batch.reward_components) == {"arithmetic", "format"}
    torch.testing.assert_close(batch.rewards, batch.reward_components["arithmetic"]
                               + 0.1 * batch.reward_components["format"])
    assert ((batch.completion_lengths >= 1) & (batch.completion_lengths <= 8)).all()
    # truncated flag agrees with lengths: a completion cut at max_tokens has exactly 8 tokens
    assert (batch.completion_lengths[batch.truncated] == 8).all()
    assert batch.ref_logprobs is not None and (batch.ref_logprobs[:, 0] < 0).all()
    assert stats.mean_reward == pytest.approx(float(batch.rewards.mean()), abs=1e-5)


def test_dynamic_sampling_drops_constant_groups_and_counts_them(engine, tmp_path):
    constant = RewardSet.from_specs([RewardSpec(name="python", args={
        "function": "tests.generator.test_loop:constant_reward"})])
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, rewards=constant, drop_constant_groups=True)
        for _ in range(2):
            assert loop.step() == []
        assert loop.stats.groups_dropped_constant == 4 and live.state.hub.depth() == 0


def constant_reward(prompt, completion, example):
    return 0.5


def test_a_group_the_hub_refuses_is_counted_and_logged_and_the_loop_goes_on(engine, tmp_path, caplog):
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        groups = loop.step()
        groups[0].rewards[1] = float("inf")   # as a reward of 1e39 became before the generator contained it
        loop.upload(groups)
        assert loop.stats.groups_uploaded == 1 and loop.stats.groups_refused_invalid == 1
        assert "the hub (422) refused a group: rewards[1] = inf" in caplog.text
        stats = loop.run(threading.Event(), max_groups=3)   # and the run goes on
        assert stats.groups_uploaded == 3 and live.state.hub.depth() == 3


def test_new_weights_are_picked_up_between_batches(engine, tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path)
        loop.run(threading.Event(), max_groups=1)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        path = tmp_path / "v7.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(path))
        HubClient(live.url).upload_weights(7, path)
        loop.run(threading.Event(), max_groups=3)
        assert loop.policy_version == 7 and loop.stats.weight_updates == 1
        batch = HubClient(live.url).get_batch(3, wait_s=10)
        assert batch.policy_versions.tolist()[:4] == [0] * 4 and set(batch.policy_versions.tolist()[4:]) == {7}
        torch.testing.assert_close(engine.model.model.norm.weight, model.model.norm.weight)


def test_late_joiner_starts_from_the_current_version(engine, tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path)) as live:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        path = tmp_path / "v3.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(path))
        HubClient(live.url).upload_weights(3, path)
        loop = make_loop(engine, live.url, tmp_path, generator_id="late")
        loop.run(threading.Event(), max_groups=1)
        assert HubClient(live.url).get_batch(1, wait_s=30).policy_versions.tolist() == [3] * 4


def test_generator_survives_a_hub_restart(engine, tmp_path):
    first = LiveServer(make_config(tmp_path)).__enter__()
    port = int(first.url.rsplit(":", 1)[1])
    loop = make_loop(engine, first.url, tmp_path, retry_s=60.0)
    loop.run(threading.Event(), max_groups=1)
    first.__exit__(None, None, None)
    restarted = {}

    def restart():
        time.sleep(2.0)
        restarted["server"] = LiveServer(make_config(tmp_path), port=port).__enter__()

    threading.Thread(target=restart).start()
    loop.run(threading.Event(), max_groups=3)  # uploads fail until the restart, then go through
    second = restarted["server"]
    try:
        stats = requests.get(f"{second.url}/v1/hub/stats", timeout=10).json()
        assert stats["spool_reloaded"] == 1 and stats["accepted"] == 2 and stats["queue_depth"] == 3
        assert loop.stats.groups_uploaded == 3
    finally:
        second.__exit__(None, None, None)


def test_two_generators_at_once_draw_different_prompts(engine, tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path)) as live:
        loops = [make_loop(engine, live.url, tmp_path, generator_id=name) for name in ("gen-a", "gen-b")]
        threads = [threading.Thread(target=loop.run, args=(threading.Event(), 2)) for loop in loops]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        batch = HubClient(live.url).get_batch(4, wait_s=10)
    assert sorted(batch.generator_ids) == ["gen-a", "gen-a", "gen-b", "gen-b"]
    prompts = {}
    for index, generator in enumerate(batch.generator_ids):
        row = int((batch.group_index == index).nonzero()[0])
        prompts.setdefault(generator, []).append(batch.input_ids[row, :batch.prompt_lengths[row]].tolist())
    assert prompts["gen-a"] != prompts["gen-b"]
    assert loops[0].prompts.examples == loops[1].prompts.examples  # same pool, different private orders


def test_a_paced_generator_samples_only_what_the_learner_can_train_in_time(engine, tmp_path):
    """On-policy (max_staleness 0), two groups per learner step: the generator samples two prompts, then waits
    (engine calls put off, counted) until the learner has trained them and published the next version."""
    with LiveServer(make_config(tmp_path, max_staleness=0)) as live:
        learner = HubClient(live.url)
        learner.report_version(0, groups_per_step=2)
        loop = make_loop(engine, live.url, tmp_path, budget_poll_s=0.2)
        loop.prompts_per_batch = 4
        stop = threading.Event()
        runner = threading.Thread(target=loop.run, args=(stop,))
        runner.start()
        try:
            wait = time.monotonic() + 60
            while loop.stats.budget_waits < 2:
                assert time.monotonic() < wait and runner.is_alive()
                time.sleep(0.05)
            assert loop.stats.prompts == 2 and live.state.hub.depth() == loop.stats.groups_uploaded <= 2
            assert loop.stats.budget_wait_s >= 0.2
        finally:
            stop.set()
            runner.join(60)
    assert not runner.is_alive()


def test_an_unpaced_generator_keeps_sampling(engine, tmp_path):
    with LiveServer(make_config(tmp_path, max_staleness=0)) as live:
        HubClient(live.url).report_version(0, groups_per_step=2)
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.run(threading.Event(), max_groups=5)
        assert loop.stats.budget_waits == 0 and live.state.hub.depth() == 5


def test_a_paced_generator_asks_for_enough_prompts_to_fill_what_is_wanted(engine, tmp_path):
    """With half the groups dropped by dynamic sampling, 3 wanted groups take 6 prompts (capped by the batch)."""
    with LiveServer(make_config(tmp_path, max_staleness=0)) as live:
        HubClient(live.url).report_version(0, groups_per_step=3)
        loop = make_loop(engine, live.url, tmp_path, budget_poll_s=0.2)
        loop.prompts_per_batch = 8
        loop.kept_fraction = 0.5
        assert loop.prompts_wanted() == 6
        loop.kept_fraction = 0.2
        assert loop.prompts_wanted() == 8
        loop.step(4)  # every group kept (no dynamic sampling here): the share moves towards 1
        assert loop.kept_fraction == pytest.approx(0.2 + (4 / 64) * 0.8)


def line_steps(prompt, completion, example):
    """A step every 2 characters (reward: its parity), so the tiny model's completions have several."""
    from generator.rewards import StepScores

    ends = sorted({*range(2, len(completion), 2), len(completion)} - {0})
    return StepScores([float(j % 2) for j in range(len(ends))], ends=ends)


def test_step_rewards_reach_the_batch(engine, tmp_path, tiny_model_dir):
    """A step reward's groups are accepted by the hub and lease with their steps at the right rows; the loop's
    counts agree with the batch."""
    rewards = RewardSet.from_specs([RewardSpec(name="arithmetic"), RewardSpec(name="python", label="steps", args={
        "function": "tests.generator.test_loop:line_steps"})])
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        loop = make_loop(engine, live.url, tmp_path, rewards=rewards)
        groups = loop.step()
        loop.upload(groups)
        assert loop.stats.groups_uploaded == 2 and loop.stats.groups_with_steps == 2
        batch = HubClient(live.url).get_batch(2, wait_s=20)
    sent = torch.cat([g.step_rewards for g in groups])
    assert loop.stats.steps_uploaded == sent.numel() and loop.stats.step_reward_errors == 0
    assert sorted(batch.step_rewards.tolist()) == sorted(sent.tolist())
    # each row's last step ends at its last token (final_step carries the arithmetic outcome there)
    for row in range(batch.batch_size):
        ends = batch.step_end[batch.step_index == row]
        assert int(ends[-1]) == int(batch.completion_lengths[row]) - 1


def solved_only_for_the_first(prompts, completions, answer, **kwargs):
    """TRL-style: the example whose answer is the first pool's is solved by every completion; any other by one."""
    return [1.0] * len(completions) if answer[0] == FIRST_ANSWER[0] else [1.0] + [0.0] * (len(completions) - 1)


FIRST_ANSWER: list = []


def test_the_curriculum_stops_drawing_a_prompt_solved_every_time(engine, tmp_path):
    """generator.curriculum through the loop: the prompt every completion solves is settled after two groups and
    never drawn again; the others (one completion in four solved) keep coming; the passed-over draws are counted."""
    from generator.curriculum import curriculum_stream
    from shared.config.schema.generator import CurriculumConfig

    examples = arithmetic_examples(ArithmeticTask(), "train", 3, seed=0)
    FIRST_ANSWER[:] = [examples[0].data["answer"]]
    rewards = RewardSet.from_specs([RewardSpec(name="python", args={
        "function": "tests.generator.test_loop:solved_only_for_the_first"})])
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, rewards=rewards)
        loop.prompts = curriculum_stream(PromptStream(examples, seed=0, generator_id="gen-a"),
                                         CurriculumConfig(enabled=True, window=4, min_appearances=2), seed=0)
        for _ in range(8):   # 16 draws from 3 prompts
            loop.step()
        first_id = examples[0].example_id
        settled_after = loop.prompts.table.shares(first_id)
    assert settled_after == [1.0, 1.0] and loop.prompts.table.is_settled(first_id)
    assert loop.stats.prompts_skipped == loop.prompts.skipped > 0
    assert all(0.0 < s < 1.0 for e in examples[1:] for s in loop.prompts.table.shares(e.example_id))


def test_two_generators_share_the_hubs_curriculum_table(engine, tmp_path):
    """generator.curriculum.shared: two loops report to one hub; a prompt settles from both generators' groups
    together, and then neither draws it (nor does the one that saw it less than min_appearances times)."""
    from generator.curriculum import curriculum_stream
    from shared.config.schema.generator import CurriculumConfig

    examples = arithmetic_examples(ArithmeticTask(), "train", 3, seed=0)
    FIRST_ANSWER[:] = [examples[0].data["answer"]]
    first_id = examples[0].example_id
    rewards = RewardSet.from_specs([RewardSpec(name="python", args={
        "function": "tests.generator.test_loop:solved_only_for_the_first"})])
    with LiveServer(make_config(tmp_path)) as live:
        loops = [make_loop(engine, live.url, tmp_path, generator_id=g, rewards=rewards) for g in ("gen-a", "gen-b")]
        for loop in loops:
            loop.prompts = curriculum_stream(PromptStream(examples, seed=0, generator_id=loop.generator_id),
                                             CurriculumConfig(enabled=True, window=4, min_appearances=2), seed=0,
                                             client=loop.client, sync_interval_s=0)
        drawn = {loop.generator_id: [] for loop in loops}
        for _ in range(5):
            for loop in loops:
                drawn[loop.generator_id].append([g.task["example_id"] for g in loop.step()])
        hub = live.state.curriculum
        own = {loop.generator_id: loop.prompts.table.shares(first_id) for loop in loops}
        assert hub.rates.is_settled(first_id) and set(hub.rates.shares(first_id)) == {1.0}
        assert sum(len(s) for s in own.values()) == len(hub.rates.shares(first_id))  # one table, both fill it
        assert all(loop.prompts.table.is_settled(first_id) for loop in loops)
        # after the last step's reports: every group both generators scored is in the hub's table
        for loop in loops:
            loop.prompts.take(0)
        assert hub.recorded == sum(loop.stats.prompts for loop in loops)
        assert hub.skipped == sum(loop.stats.prompts_skipped for loop in loops) > 0
    # each generator drew ex0 once in the first round: settled only by the two together, then drawn by neither
    assert own == {"gen-a": [1.0], "gen-b": [1.0]}
    assert all(first_id in batches[0] and not any(first_id in ids for ids in batches[1:])
               for batches in drawn.values())


def test_an_upload_over_the_hubs_request_limit_goes_in_halves_and_a_group_over_it_alone_is_refused(engine, tmp_path,
                                                                                                 caplog):
    """ref_server.max_request_bytes bounds one upload: the hub answered 413 to the engine call's request and the
    generator died with it (an upload of many long groups). Now the request goes again in halves; a group that is
    over the limit by itself can never be accepted: counted, logged once and dropped, as the hub's refusals."""
    from shared.protocol.records import RolloutGroup

    def group(tokens: int) -> RolloutGroup:
        return RolloutGroup.from_samples(
            prompt_ids=[1, 2, 3], completion_ids=[[5] * tokens, [6] * tokens],
            behaviour_logprobs=[[-1.0] * tokens] * 2, rewards=[0.0, 1.0], finish_reasons=["length"] * 2,
            policy_version=0, generator_id="gen-a", sampling=SamplingParams(temperature=1.0, max_tokens=tokens))

    with LiveServer(make_config(tmp_path, max_request_bytes=4096)) as live:
        loop = make_loop(engine, live.url, tmp_path)
        groups = [group(10), group(10), group(10), group(600), group(10)]
        assert len(groups[3].to_bytes()) > 4096 > 2 * len(groups[0].to_bytes()) + 512
        loop.upload(groups)
        assert live.state.hub.depth() == 4 and live.state.hub.counters.accepted == 4
    assert loop.stats.groups_uploaded == 4 and loop.stats.groups_refused_invalid == 1
    assert sum(loop.refusals.kinds.values()) == 1 and "larger than the hub takes in one request" in caplog.text
