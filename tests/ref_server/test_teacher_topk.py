"""Top-k distillation on the hub (algorithm.distill.mode topk_forward_kl): the teacher's top-k next tokens per
completion position laid out in the batch (rows, padding, wire round trip, absent otherwise), malformed fields
refused with a reason, and a hub whose teacher scores with top-k giving exactly the teacher's own top-k."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ref_server.hub.batching import GroupRows, assemble_batch
from ref_server.hub.rollout_hub import RolloutHub
from ref_server.scoring.scorer import ReferenceScorer, TopRow
from ref_server.scoring.top_logprobs import sequence_top_logprobs
from shared.protocol import teacher_topk
from shared.protocol.numbers import batch_problem
from shared.protocol.records import TrainBatch
from shared.protocol.wire import WireError, decode, encode

from .helpers import make_group

K = 3


def _top_rows(group, seed: int) -> list[TopRow]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in group.completion_lengths.tolist():
        top = -torch.rand(n + 1, K, generator=gen).sort(dim=1).values.flip(1).abs()
        rows.append(TopRow(-torch.rand(n, generator=gen), top, torch.randint(0, 40, (n + 1, K), generator=gen)))
    return rows


def _batch():
    groups = [make_group(seed=0), make_group(seed=1, prompt=(5,), lengths=(6, 0, 2, 2))]
    teachers = [_top_rows(g, i) for i, g in enumerate(groups)]
    rows = [GroupRows.of(g, None, t) for g, t in zip(groups, teachers)]
    return groups, teachers, assemble_batch(groups, rows, batch_id="b")


def test_rows_carry_the_teachers_topk_per_completion_token():
    groups, teachers, batch = _batch()
    assert batch.teacher_topk_ids.shape == (8, 6, K) and batch.teacher_topk_ids.dtype == torch.int32
    assert batch.teacher_topk_logprobs.shape == (8, 6, K) and batch.teacher_topk_logprobs.dtype == torch.float32
    row = 0
    for group, scored in zip(groups, teachers):
        for i, n in enumerate(group.completion_lengths.tolist()):
            # the first n of the scorer's n + 1 distributions: those predicting the completion's tokens
            assert torch.equal(batch.teacher_topk_ids[row, :n], scored[i].top_ids[:n].int())
            assert torch.equal(batch.teacher_topk_logprobs[row, :n], scored[i].top_logprobs[:n])
            assert (batch.teacher_topk_ids[row, n:] == 0).all() and (batch.teacher_topk_logprobs[row, n:] == 0).all()
            assert torch.equal(batch.teacher_logprobs[row, :n], scored[i].logprobs)
            row += 1
    again = TrainBatch.from_bytes(batch.to_bytes())
    assert torch.equal(again.teacher_topk_ids, batch.teacher_topk_ids)
    assert torch.equal(again.teacher_topk_logprobs, batch.teacher_topk_logprobs)
    assert batch_problem(again, vocab_size=40) is None
    one = batch.select_groups([1])
    assert torch.equal(one.teacher_topk_ids, batch.teacher_topk_ids[4:, :6])
    assert torch.equal(one.teacher_topk_logprobs, batch.teacher_topk_logprobs[4:, :6])


def test_absent_when_unused_so_the_wire_is_unchanged():
    groups = [make_group(seed=0)]
    plain = assemble_batch(groups, [GroupRows.of(groups[0], None, [-torch.rand(int(n)) for n in
                                                                 groups[0].completion_lengths])], batch_id="b")
    assert plain.teacher_topk_ids is None and plain.teacher_topk_logprobs is None
    tensors, _ = decode(plain.to_bytes(), "train_batch/v2")
    assert not {teacher_topk.IDS, teacher_topk.LOGPROBS} & set(tensors)
    again = TrainBatch.from_bytes(plain.to_bytes())
    assert again.teacher_topk_ids is None and again.teacher_topk_logprobs is None


def _with(batch: TrainBatch, **replaced) -> bytes:
    tensors, fields = decode(batch.to_bytes(), "train_batch/v2")
    for name, value in replaced.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return encode("train_batch/v2", tensors, fields)


@pytest.mark.parametrize("change, reason", [
    ({teacher_topk.LOGPROBS: None}, "come together"),
    ({teacher_topk.IDS: None}, "come together"),
    ({teacher_topk.IDS: torch.zeros(8, 6, K, dtype=torch.int64)}, "must be int32"),
    ({teacher_topk.LOGPROBS: torch.zeros(8, 6, K, dtype=torch.float16)}, "float32"),
    ({teacher_topk.IDS: torch.zeros(8, 5, K, dtype=torch.int32),
      teacher_topk.LOGPROBS: torch.zeros(8, 5, K)}, r"\[B, L, k\] = \[8, 6, k >= 1\]"),
    ({teacher_topk.IDS: torch.zeros(8, 6, 0, dtype=torch.int32),
      teacher_topk.LOGPROBS: torch.zeros(8, 6, 0)}, "k >= 1"),
    ({teacher_topk.IDS: torch.zeros(8, 6, K, dtype=torch.int32),
      teacher_topk.LOGPROBS: torch.zeros(8, 6, K + 1)}, "must both be"),
])
def test_malformed_topk_fields_are_refused_with_a_reason(change, reason):
    _, _, batch = _batch()
    with pytest.raises(WireError, match=reason):
        TrainBatch.from_bytes(_with(batch, **change))


def test_values_the_learner_cannot_train_on_are_named():
    _, _, batch = _batch()
    ids = batch.teacher_topk_ids.clone()
    ids[1, 0, 2] = 40
    assert "token ids must be in [0, 40)" in batch_problem(TrainBatch.from_bytes(
        _with(batch, **{teacher_topk.IDS: ids})), vocab_size=40)
    logprobs = batch.teacher_topk_logprobs.clone()
    logprobs[0, 1, 0] = float("nan")
    assert "not finite" in batch_problem(TrainBatch.from_bytes(_with(batch, **{teacher_topk.LOGPROBS: logprobs})), 40)
    logprobs[0, 1, 0] = 0.5
    assert "above 0" in batch_problem(TrainBatch.from_bytes(_with(batch, **{teacher_topk.LOGPROBS: logprobs})), 40)
    logprobs[0, 1, 0], logprobs[1, 5, 0] = -1.0, float("nan")   # past row 1's length (1): padding is not read
    assert batch_problem(TrainBatch.from_bytes(_with(batch, **{teacher_topk.LOGPROBS: logprobs})), 40) is None


def test_a_hub_with_a_topk_teacher_batches_the_teachers_own_topk(tiny_model_dir):
    """The hub's teacher (here its own scorer, the same pool as the reference: scored once) asked for top-k: the
    batch holds sequence_top_logprobs of the teacher at the group's temperature, the reference logprobs the same
    scoring's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    scorer = ReferenceScorer(model, vocab_size=model.config.vocab_size, max_context=256, packing="padded")
    hub = RolloutHub(capacity=8, max_staleness=4, scorer=scorer, vocab_size=model.config.vocab_size,
                     teacher=scorer, teacher_top_k=4)
    try:
        group = make_group(seed=3, temperature=0.7)
        hub.report_version(0)
        hub.put(group.to_bytes())
        batch = hub.take(1, timeout=30)
    finally:
        scorer.close()
    lengths = group.completion_lengths
    ids = torch.cat([group.prompt_ids.expand(4, -1), group.completion_ids], dim=1)
    with torch.no_grad():
        want = sequence_top_logprobs(model, ids, [3] * 4, lengths, k=4, temperature=0.7)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(batch.teacher_topk_ids[i, :n], want.top_ids[i, :n].int())
        torch.testing.assert_close(batch.teacher_topk_logprobs[i, :n], want.top_logprobs[i, :n], atol=1e-6, rtol=0)
        torch.testing.assert_close(batch.teacher_logprobs[i, :n], want.logprobs[i, :n], atol=1e-6, rtol=0)
    assert torch.equal(batch.ref_logprobs, batch.teacher_logprobs)
    assert (batch.teacher_topk_logprobs[:, :, :-1] >= batch.teacher_topk_logprobs[:, :, 1:]).all()  # most likely first


def test_a_joined_teacher_scorer_gets_top_k_jobs_and_a_malformed_answer_is_refused():
    """The teacher's pool without a local model (``grpo scorer --teacher`` processes): the hub's job asks for the
    top-k; a result without its top-k tensors, or of the wrong k, is a BadResult (the route's 422, the job back in
    the queue); a right one lands in the batch."""
    from ref_server.scorer_pool.job_wire import BadResult, encode_result
    from ref_server.scorer_pool.pool import ScorerPool

    pool = ScorerPool(local=None, vocab_size=40, role="teacher", reaper=False)
    hub = RolloutHub(capacity=8, max_staleness=4, scorer=None, vocab_size=40, teacher=pool, teacher_top_k=K)
    try:
        group = make_group(seed=5)
        hub.report_version(0)
        hub.put(group.to_bytes())
        scorer = pool.register("t1")
        job = pool.take(scorer, wait_s=5)
        assert job.top_k == K
        rows = _top_rows(group, 9)
        plain = encode_result(job.job_id, [r.logprobs for r in rows])
        with pytest.raises(BadResult, match="the job needs"):
            pool.finish(scorer, job.job_id, plain)
        narrow = encode_result(job.job_id, [TopRow(r.logprobs, r.top_logprobs[:, :2], r.top_ids[:, :2]) for r in rows])
        with pytest.raises(BadResult, match="top_logprobs has shape"):
            pool.finish(scorer, job.job_id, narrow)
        job = pool.take(scorer, wait_s=5)  # back in the queue after the bad results
        assert pool.finish(scorer, job.job_id, encode_result(job.job_id, rows)) == "scored"
        batch = hub.take(1, timeout=10)
    finally:
        pool.close()
    n = int(group.completion_lengths[0])
    assert torch.equal(batch.teacher_topk_ids[0, :n], rows[0].top_ids[:n].int())
    assert torch.equal(batch.teacher_topk_logprobs[0, :n], rows[0].top_logprobs[:n])
