"""The teacher of on-policy distillation on the hub (ref_server.teacher_model): the tokenizer check, each group
scored by the teacher beside the reference and carried in the batch (and its wire form), /v1/logprobs answering
for it, and scorers joining its pool (``grpo scorer --teacher``)."""

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir
from ref_server.hub.batching import GroupRows, assemble_batch
from ref_server.scoring.teacher import TokenizerMismatch, check_same_tokenizer
from shared.forward.logprobs import sequence_logprobs
from shared.protocol.records import TrainBatch
from tests.live_server import LiveServer, make_config

from .helpers import make_group

PINNED = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model (other weights) with the tiny model's tokenizer."""
    tokenizer = build_char_tokenizer()
    return save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=7)), tokenizer,
                          tmp_path_factory.mktemp("teacher"))


def _logprobs(folder, rows: list[list[int]], prompt: int) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for ids in rows:
        with torch.no_grad():
            result = sequence_logprobs(model, torch.tensor([ids]), [prompt], [len(ids) - prompt])
        out.append(result.logprobs[0, :len(ids) - prompt])
    return out


def test_tokenizers_with_other_vocabularies_are_refused_naming_both(tmp_path, tiny_model_dir, teacher_dir):
    check_same_tokenizer(str(tiny_model_dir), str(teacher_dir))  # one tokenizer, two folders: fine
    other = build_char_tokenizer("0123456789+-= abc")
    odd = save_model_dir(build_tiny_model(other, TinyModelSpec(seed=3)), other, tmp_path / "odd")
    with pytest.raises(TokenizerMismatch) as caught:
        check_same_tokenizer(str(tiny_model_dir), str(odd), student_key="learner.model")
    message = str(caught.value)
    assert str(odd) in message and str(tiny_model_dir) in message and "learner.model" in message
    assert "ref_server.teacher_model" in message and "different vocabularies" in message
    with pytest.raises(TokenizerMismatch, match="teacher_model"):  # and at start, before any model loads
        LiveServer(make_config(tmp_path, tiny_model_dir, teacher_model=str(odd), **PINNED))


def test_rows_carry_the_teacher_exactly_as_from_groups():
    groups = [make_group(seed=0), make_group(seed=1, prompt=(5,), lengths=(6, 0, 2, 2))]
    refs = [[-torch.rand(int(n)) for n in g.completion_lengths] for g in groups]
    teachers = [[-torch.rand(int(n)) for n in g.completion_lengths] for g in groups]
    rows = [GroupRows.of(g, r, t) for g, r, t in zip(groups, refs, teachers)]
    got = assemble_batch(groups, rows, batch_id="b")
    pad = [torch.nn.utils.rnn.pad_sequence(t, batch_first=True) for t in teachers]
    want = TrainBatch.from_groups(groups, [torch.nn.utils.rnn.pad_sequence(r, batch_first=True) for r in refs],
                                  batch_id="b", teacher_logprobs=pad)
    assert torch.equal(got.teacher_logprobs, want.teacher_logprobs) and torch.equal(got.ref_logprobs,
                                                                                    want.ref_logprobs)
    assert torch.equal(got.teacher_logprobs[4, :6], teachers[1][0])  # group 1's first row, 6 tokens
    again = TrainBatch.from_bytes(got.to_bytes())
    assert torch.equal(again.teacher_logprobs, got.teacher_logprobs)
    assert torch.equal(got.select_groups([1]).teacher_logprobs, got.teacher_logprobs[4:, :6])
    plain = assemble_batch(groups, [GroupRows.of(g, r) for g, r in zip(groups, refs)], batch_id="b")
    assert plain.teacher_logprobs is None and TrainBatch.from_bytes(plain.to_bytes()).teacher_logprobs is None


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_hub_scores_each_group_with_the_teacher(tmp_path, tiny_model_dir, teacher_dir, beta):
    config = make_config(tmp_path, tiny_model_dir, teacher_model=str(teacher_dir), beta=beta, **PINNED)
    with LiveServer(config) as live:
        assert live.get("/healthz").json()["teacher_model"] == teacher_dir.name
        group = make_group(seed=3)
        live.state.hub.report_version(0)
        live.state.hub.put(group.to_bytes())
        batch = live.state.hub.take(1, timeout=30)
        prompt = group.prompt_ids.tolist()
        rows = [prompt + group.completion_ids[i, :int(n)].tolist() for i, n in enumerate(group.completion_lengths)]
        teacher, reference = _logprobs(teacher_dir, rows, len(prompt)), _logprobs(tiny_model_dir, rows, len(prompt))
        for i, want in enumerate(teacher):
            torch.testing.assert_close(batch.teacher_logprobs[i, :want.numel()], want, atol=1e-5, rtol=0)
            assert not torch.allclose(want, reference[i], atol=1e-3)  # another model: other numbers
            if beta:
                torch.testing.assert_close(batch.ref_logprobs[i, :want.numel()], reference[i], atol=1e-5, rtol=0)
        assert (batch.ref_logprobs is None) == (beta == 0)
        # /v1/logprobs answers for either model, by name in the body or the query
        body = {"input_ids": rows[:1], "prompt_lengths": [len(prompt)]}
        by_teacher = live.post("/v1/logprobs", json={**body, "model": "teacher"}).json()["logprobs"][0]
        torch.testing.assert_close(torch.tensor(by_teacher), teacher[0], atol=1e-5, rtol=0)
        assert live.post("/v1/logprobs?model=" + teacher_dir.name, json=body).json()["logprobs"][0] == by_teacher
        plain = live.post("/v1/logprobs", json=body)
        assert plain.status_code == (200 if beta else 503)
        unknown = live.post("/v1/logprobs", json={**body, "model": "gpt-5"})
        assert unknown.status_code == 422 and "'teacher'" in unknown.json()["detail"]


@pytest.mark.slow
def test_one_folder_is_loaded_once_and_teacher_scorers_join_its_pool(tmp_path, tiny_model_dir, teacher_dir):
    from ref_server.scorer_pool.job_wire import model_identity

    with LiveServer(make_config(tmp_path, tiny_model_dir, teacher_model=str(tiny_model_dir), **PINNED)) as live:
        assert live.state.teacher is live.state.scorer
        live.state.hub.report_version(0)
        live.state.hub.put(make_group(seed=4).to_bytes())
        batch = live.state.hub.take(1, timeout=30)
        assert torch.equal(batch.teacher_logprobs, batch.ref_logprobs)  # one scoring, both fields
        assert live.state.scorer.counters.jobs_submitted == 1
    with LiveServer(make_config(tmp_path / "b", tiny_model_dir, teacher_model=str(teacher_dir), local_scoring=False,
                                **PINNED)) as live:
        register = {"name": "t1", "vocab_size": live.state.vocab_size, "role": "teacher"}
        refused = live.post("/v1/scorers", json={**register, **model_identity(str(tiny_model_dir))})
        assert refused.status_code == 409 and "teacher_model" in refused.json()["detail"]
        joined = live.post("/v1/scorers", json={**register, **model_identity(str(teacher_dir))})
        scorer_id = joined.json()["scorer_id"]
        assert joined.status_code == 200 and live.state.teacher.scorers() == 1 and live.state.scorer.scorers() == 0
        assert live.get("/healthz").json()["teacher_scoring"] == "1 joined"
        assert live.post(f"/v1/scorers/{scorer_id}/heartbeat").status_code == 200
        assert requests.delete(f"{live.url}/v1/scorers/{scorer_id}", timeout=10).json() == {"requeued": 0}
        assert live.state.teacher.scorers() == 0


def test_preflight_checks_the_teacher_folder(tmp_path, tiny_model_dir):
    from deploy.preflight import model_problems
    from shared.config.loader import load_config

    config = load_config(None, [f"ref_server.teacher_model={tmp_path / 'missing'}", f"learner.model={tiny_model_dir}",
                                f"generator.model={tiny_model_dir}"])
    problems = model_problems(config)
    assert len(problems) == 1 and problems[0].startswith("ref_server.teacher_model") and "missing" in problems[0]


@pytest.mark.slow
def test_a_grpo_scorer_teacher_process_scores_the_teacher(tmp_path, tiny_model_dir, teacher_dir):
    from tests.ref_server.test_scorer_processes import start_scorer, stop, wait_for

    config = make_config(tmp_path, tiny_model_dir, teacher_model=str(teacher_dir), local_scoring=False, **PINNED)
    with LiveServer(config) as live:
        scorer = start_scorer(live.url, teacher_dir, "t-a", tmp_path, "--teacher")
        try:
            wait_for(lambda: live.state.teacher.scorers() == 1, 300, "the teacher scorer to join")
            assert live.state.scorer.scorers() == 0  # it joined the teacher's pool, not the reference's
            rows, prompt = [[5, 6, 7, 8, 9, 10], [5, 6, 11]], 2
            body = {"input_ids": rows, "prompt_lengths": [prompt, prompt], "model": "teacher"}
            answer = live.post("/v1/logprobs", json=body).json()["logprobs"]
            for got, want in zip(answer, _logprobs(teacher_dir, rows, prompt)):
                torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
        finally:
            assert stop(scorer) == 0
