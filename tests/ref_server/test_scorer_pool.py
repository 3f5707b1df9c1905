"""The scorer pool (ref_server/scorer_pool/pool.py) in process: leases, expiry, exactly-once results, checks on results."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_server.scorer_pool.job_wire import BadResult, check_result, decode_job, encode_job, encode_result
from ref_server.scorer_pool.pool import LOCAL, ScorerPool, ScorerQuarantined, UnknownJob, UnknownScorer
from ref_server.scoring.scorer import ReferenceScorer, Row, ScorerBusy, ScoringError, TopRow
from shared.protocol.wire import encode

VOCAB = 50


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def pool(clock):
    pool = ScorerPool(local=None, vocab_size=VOCAB, lease_s=10.0, wait_s=0.2, max_jobs=8, clock=clock,
                      reaper=False)
    yield pool
    pool.close()


def rows_of(*lengths, prompt=2):
    return [Row(list(range(1, n + 1)), prompt) for n in lengths]


def answer(job, value=-0.5, top_k=0):
    """A valid result for ``job``: every logprob ``value``."""
    rows = [torch.full((r.tokens - r.prompt_length,), value) for r in job.rows]
    if top_k:
        rows = [TopRow(lp, torch.full((lp.numel() + 1, top_k), -1.0), torch.zeros(lp.numel() + 1, top_k,
                                                                                   dtype=torch.long))
                for lp in rows]
    return encode_result(job.job_id, rows)


def test_a_job_travels_as_safetensors_and_back():
    rows = [Row(torch.tensor([3, 4, 5, 6]), 2), Row([7, 8, 9], 1)]
    from ref_server.scorer_pool.job_wire import JobSpec
    job = decode_job(encode_job(JobSpec("j-1", rows, 0.7, 3)))
    assert job.job_id == "j-1" and job.temperature == pytest.approx(0.7) and job.top_k == 3
    assert [r.input_ids.tolist() for r in job.rows] == [[3, 4, 5, 6], [7, 8, 9]]
    assert [r.prompt_length for r in job.rows] == [2, 1]


def test_an_expired_lease_puts_the_job_back_for_another_scorer_and_the_first_valid_result_wins(pool, clock):
    a, b = pool.register("a"), pool.register("b")
    future = pool.submit(rows_of(5, 4), temperature=1.0)
    job = pool.take(a, 0)
    assert job is not None and pool.take(b, 0) is None and pool.leased() == 1
    clock.now += 5
    pool.heartbeat(a)  # renews a's lease: nothing goes back
    pool.heartbeat(b)
    clock.now += 6
    assert pool.expire() == 0 and pool.queue_depth() == 0
    clock.now += 5  # a silent for 11 s > lease: removed, its job back at the front
    pool.heartbeat(b)
    assert pool.expire() == 1 and pool.queue_depth() == 1 and pool.scorers() == 1
    with pytest.raises(UnknownScorer):
        pool.take(a, 0)
    again = pool.take(b, 0)
    assert again.job_id == job.job_id
    # a, killed only in the hub's eyes, answers after all: first valid result, it wins
    assert pool.finish(a, job.job_id, answer(job, -0.25)) == "scored"
    assert pool.finish(b, job.job_id, answer(job, -0.75)) == "duplicate"
    assert pool.finish(b, job.job_id, answer(job, -0.75)) == "duplicate"
    result = future.result(timeout=1)
    assert [r.tolist() for r in result] == [[-0.25] * 3, [-0.25] * 2]
    c = pool.counters
    assert (c.jobs_scored, c.results_duplicate, c.jobs_requeued, c.scorers_lost) == (1, 2, 1, 1)
    assert pool.leased() == 0 and pool.queue_depth() == 0


def test_a_malformed_result_is_refused_and_its_job_goes_back(pool):
    pool.max_bad_results = pool.job_max_failures = 10   # the checks alone (quarantine: test_scorer_quarantine.py)
    a = pool.register("a")
    future = pool.submit(rows_of(4, 6))
    job = pool.take(a, 0)
    bad = [encode_result(job.job_id, [torch.full((2,), -0.1), torch.full((3,), -0.1)]),  # one short
           encode_result(job.job_id, [torch.full((2,), 0.5), torch.full((4,), -0.1)]),   # a logprob > 0
           encode_result(job.job_id, [torch.full((2,), float("nan")), torch.full((4,), -0.1)]),
           encode("scoring_result/v1", {"logprobs": torch.full((6,), -0.1, dtype=torch.float64)}, {"job_id": "x"}),
           b"not safetensors"]
    for data in bad:
        with pytest.raises(BadResult):
            pool.finish(a, job.job_id, data)
        assert pool.queue_depth() == 1 and not future.done()  # back at the front of the queue
        assert pool.take(a, 0).job_id == job.job_id
    assert pool.counters.results_refused == len(bad)
    assert pool.finish(a, job.job_id, answer(job)) == "scored"
    assert [r.numel() for r in future.result(timeout=1)] == [2, 4]


def test_a_scorer_is_quarantined_after_max_bad_results_and_the_others_get_its_jobs(pool):
    pool.max_bad_results = 2
    a, b = pool.register("a"), pool.register("b")
    futures = [pool.submit(rows_of(4)), pool.submit(rows_of(3))]
    first, second = pool.take(a, 0), pool.take(a, 0)
    with pytest.raises(BadResult):
        pool.finish(a, first.job_id, encode_result(first.job_id, [torch.full((1,), -0.1)]))  # the wrong shape
    assert pool.scorers() == 2 and pool.queue_depth() == 1
    with pytest.raises(UnknownJob):
        pool.finish(a, "not-its-job", answer(second))   # a result for a job it does not hold: the second bad one
    # quarantined: out of the pool, the job it still held back in the queue at once, refused from now on
    assert pool.scorers() == 1 and pool.queue_depth() == 2 and pool.counters.scorers_quarantined == 1
    for call in (lambda: pool.take(a, 0), lambda: pool.heartbeat(a), lambda: pool.register("a"),
                 lambda: pool.finish(a, second.job_id, answer(second))):
        with pytest.raises(ScorerQuarantined, match="ref_server.scorer_max_bad_results is 2"):
            call()
    for _ in range(2):
        job = pool.take(b, 0)
        assert pool.finish(b, job.job_id, answer(job)) == "scored"
    assert [len(f.result(timeout=1)) for f in futures] == [1, 1] and pool.counters.results_refused == 2


def test_a_job_failing_job_max_failures_times_fails_its_future_instead_of_going_round(pool, clock):
    pool.job_max_failures = 2
    a = pool.register("a")
    future = pool.submit(rows_of(4))
    pool.take(a, 0)
    clock.now += 11   # a's lease (10 s) runs out without a heartbeat: a failed attempt
    assert pool.expire() == 1 and not future.done()
    b = pool.register("b")
    job = pool.take(b, 0)
    with pytest.raises(BadResult):
        pool.finish(b, job.job_id, encode_result(job.job_id, [torch.full((2,), float("nan"))]))
    with pytest.raises(ScoringError, match=r"failed 2 times on joined scorers \(ref_server.scoring_job_max_failures "
                                           r"is 2\): the lease of scorer .* expired; scorer .*not finite"):
        future.result(timeout=5)
    assert pool.queue_depth() == 0 and pool.leased() == 0 and pool.take(b, 0) is None
    assert pool.counters.jobs_given_up == 1 and pool.counters.scorers_quarantined == 0
    assert pool.finish(b, job.job_id, answer(job)) == "duplicate"   # a late result for it is ignored


def test_results_count_only_from_a_scorer_the_job_was_leased_to(pool):
    a, b = pool.register("a"), pool.register("b")
    pool.submit(rows_of(4))
    job = pool.take(a, 0)
    with pytest.raises(UnknownJob):
        pool.finish(b, job.job_id, answer(job))
    with pytest.raises(UnknownJob):
        pool.finish(a, "no-such-job", answer(job))


def test_a_leaving_scorer_hands_its_jobs_back_at_once(pool):
    a, b = pool.register("a"), pool.register("b")
    futures = [pool.submit(rows_of(3)), pool.submit(rows_of(4))]
    held = {pool.take(a, 0).job_id, pool.take(a, 0).job_id}
    assert pool.leave(a) == 2 and pool.queue_depth() == 2 and pool.scorers() == 1
    retaken = set()
    for _ in range(2):
        job = pool.take(b, 0)
        retaken.add(job.job_id)
        assert pool.finish(b, job.job_id, answer(job)) == "scored"
    assert retaken == held and [len(f.result(timeout=1)) for f in futures] == [1, 1]


def test_a_long_poll_returns_the_job_submitted_while_it_waits(pool):
    a = pool.register("a")
    got = []
    poller = threading.Thread(target=lambda: got.append(pool.take(a, 5.0)))
    poller.start()
    pool.submit(rows_of(4))
    poller.join(timeout=5)
    assert got and got[0] is not None


def test_cancelled_jobs_leave_the_queue_and_a_late_result_is_ignored(pool):
    a = pool.register("a")
    leased, waiting = pool.submit(rows_of(3)), pool.submit(rows_of(4))
    job = pool.take(a, 0)  # the first (FIFO)
    waiting.cancel()  # a route stopped waiting for it
    assert pool.queue_depth() == 0 and pool.leased() == 1
    leased.cancel()
    assert pool.leased() == 0 and pool.take(a, 0) is None
    assert pool.finish(a, job.job_id, answer(job)) == "duplicate"  # acknowledged, ignored
    assert pool.counters.jobs_cancelled == 2 and pool.counters.jobs_scored == 0


def test_with_no_scorer_a_route_gets_a_503_reason_after_the_bounded_wait(pool):
    import asyncio

    from ref_server.scorer_pool.pool import NoScorer

    assert pool.status() == "no scorer" and pool.wait_s() == pytest.approx(0.2)
    future = pool.submit(rows_of(4))
    with pytest.raises(NoScorer, match="no reference scorer answered within 0s .scoring: no scorer"):
        asyncio.run(pool.result(future))
    assert future.cancelled() and pool.queue_depth() == 0


def test_the_pool_is_bounded(pool):
    for _ in range(8):
        pool.submit(rows_of(3))
    with pytest.raises(ScorerBusy):
        pool.submit(rows_of(3))


def test_local_scoring_through_the_pool_equals_the_scorer_itself(tiny_model):
    vocab = tiny_model.config.vocab_size
    direct = ReferenceScorer(tiny_model, vocab_size=vocab, max_context=512, batch_tokens=64)
    pool = ScorerPool(local=ReferenceScorer(tiny_model, vocab_size=vocab, max_context=512, batch_tokens=64),
                      vocab_size=vocab)
    try:
        gen = torch.Generator().manual_seed(0)
        requests = [[Row(torch.randint(0, vocab, (int(n),), generator=gen).tolist(), 3)
                     for n in torch.randint(4, 30, (3,), generator=gen)] for _ in range(12)]
        futures = [pool.submit(rows, 0.9) for rows in requests]  # more than two micro-batches: queued in the pool
        for rows, future in zip(requests, futures):
            expected = direct.score(rows, 0.9, timeout=60)
            for got, want in zip(future.result(timeout=60), expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert pool.status() == "local" and pool.wait_s() is None
        assert pool.counters.jobs_scored == 12 and pool._local_tokens == 0
        assert pool.leased() == 0 and LOCAL not in pool._scorers
    finally:
        pool.close()
        direct.close()


lengths_st = st.lists(st.integers(0, 6), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, top_k=st.sampled_from([0, 2]), shape_delta=st.integers(-2, 2),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64]),
       value=st.sampled_from([-0.5, 0.0, 1e-3, float("nan"), float("-inf")]), tops_ok=st.booleans(),
       id_value=st.sampled_from([0, VOCAB - 1, VOCAB, -1]))
def test_check_result_accepts_exactly_the_results_that_fit_their_job(lengths, top_k, shape_delta, dtype, value,
                                                                     tops_ok, id_value):
    total = sum(lengths)
    n = max(total + shape_delta, 0)
    tensors = {"logprobs": torch.full((n,), value, dtype=torch.float64).to(dtype)}
    if top_k:
        after = total + len(lengths)
        rows_after = after if tops_ok else after + 1
        tensors["top_logprobs"] = torch.full((rows_after, top_k), -1.0)
        tensors["top_ids"] = torch.full((rows_after, top_k), id_value, dtype=torch.long)
    data = encode("scoring_result/v1", tensors, {"job_id": "j"})
    valid = (n == total and dtype == torch.float32 and (n == 0 or value <= 0 and value == value
                                                         and value != float("-inf")))
    if top_k:
        valid = valid and tops_ok and 0 <= id_value < VOCAB
    if valid:
        rows = check_result(data, lengths, top_k, VOCAB)
        assert [int((r.logprobs if top_k else r).numel()) for r in rows] == lengths
    else:
        with pytest.raises(BadResult):
            check_result(data, lengths, top_k, VOCAB)
