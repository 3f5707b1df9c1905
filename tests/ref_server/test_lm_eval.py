"""lm-evaluation-harness through the ref server equals lm-eval's own ``hf`` backend on the same model folder.

The real ``lm_eval`` package (dev extra) runs its ``local-completions`` model against a live server on a local
multiple-choice task (tests/data/lm_eval: a JSONL file and its task YAML, nothing downloaded) and its ``hf``
model on the same folder in fp32; every request's log-likelihood must agree within 1e-4, its greediness flag and
the task's accuracies exactly.
"""

import socket
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # ~15 s on 2 cores: lm-eval and its hf backend load, three evaluations

REPO = Path(__file__).resolve().parents[2]
TASK = "grpo_tiny_arith"


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory):
    """simple_evaluate on the local task, offline, from the repository root (the YAML's data_files is relative)."""
    import datasets.config
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets-cache")))
        mp.chdir(REPO)
        tasks = TaskManager(include_path=str(REPO / "tests/data/lm_eval"), include_defaults=False)

        def run(model, **kwargs):
            return lm_eval.simple_evaluate(model=model, tasks=[TASK], task_manager=tasks, log_samples=True,
                                           bootstrap_iters=0, **kwargs)

        yield run


@pytest.fixture(scope="module")
def hf_results(evaluate, tiny_model_dir):
    return evaluate("hf", model_args={"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
                    batch_size=16)


def per_request(results) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc_id, choice) -> (log-likelihood, is_greedy) of every request lm-eval made."""
    return {(sample["doc_id"], i): resp[0] for sample in results["samples"][TASK]
            for i, resp in enumerate(sample["resps"])}


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_through_the_server_matches_its_hf_backend(evaluate, hf_results, shared_server, tokenized):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # tokenizer_backend "auto" finds /tokenizer_info + /tokenize and counts context tokens with the server's own
    # tokenizer; token ids (lm-eval's default) or text prompts, 16 requests per HTTP call
    # see test_completions._no_nagle: without it each of the remote tokenizer's requests waits ~40 ms
    shared_server.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    model = LocalCompletionsAPI(base_url=f"{shared_server.url}/v1/completions", model="tiny", batch_size=16,
                                max_length=256, tokenized_requests=tokenized, num_concurrent=2 if tokenized else 1)
    assert model.tokenizer_backend == "remote"
    served = evaluate(model)
    got, want = per_request(served), per_request(hf_results)
    assert got.keys() == want.keys() and len(got) == 24 * 4
    worst = max(abs(got[key][0] - want[key][0]) for key in want)
    print(f"lm-eval through the server ({'token ids' if tokenized else 'text'}) vs hf: max |diff| {worst:.2e} over "
          f"{len(want)} requests; acc {served['results'][TASK]['acc,none']:.4f} vs "
          f"{hf_results['results'][TASK]['acc,none']:.4f}")
    assert worst < 1e-4, worst
    assert all(got[key][1] == want[key][1] for key in want)
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"][TASK][metric] == hf_results["results"][TASK][metric]
