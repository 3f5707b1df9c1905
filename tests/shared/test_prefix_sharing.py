"""One pass of each group's prompt for all of its completions gives the padded forward's logprobs and gradients
(Llama, Qwen2; SDPA and eager attention; prompts and completions of mixed lengths, empty completions), and the
learner step uses it."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from shared.forward.logit_transform import final_logit_transform
from shared.forward.logprobs import sequence_logprobs
from shared.forward.prefix_sharing import prefix_rows
from tests.shared.test_packing import VOCAB, _tiny  # the same tiny Llama / Qwen2 shapes


def _groups(num_groups=3, group_size=4, seed=0):
    """Rows of ``num_groups`` prompts (lengths 3..8) x ``group_size`` completions (lengths 0..7), right-padded,
    with the groups' rows interleaved (a micro-batch cut by a token budget need not keep groups together)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=gen)
               for n in torch.randint(3, 9, (num_groups,), generator=gen)]
    rows = [(g, torch.randint(1, VOCAB, (int(n),), generator=gen))
            for g in range(num_groups) for n in torch.randint(0, 8, (group_size,), generator=gen)]
    rows = rows[::2] + rows[1::2]
    width = max(len(prompts[g]) + len(c) for g, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (g, completion) in enumerate(rows):
        ids[r, :len(prompts[g]) + len(completion)] = torch.cat([prompts[g], completion])
    prompt_lengths = torch.tensor([len(prompts[g]) for g, _ in rows])
    completion_lengths = torch.tensor([len(c) for _, c in rows])
    return ids, prompt_lengths, completion_lengths, torch.tensor([g for g, _ in rows])


def test_prefix_rows_finds_the_shared_prompts_and_checks_them():
    ids, prompts, completions, groups = _groups()
    prefix = prefix_rows(ids, prompts, groups)
    assert prefix.num_prompts == 3
    for r in range(len(ids)):  # each row's prompt is the prompt of the row standing for it
        lead = int(prefix.prompt_rows[prefix.row_prompt[r]])
        assert torch.equal(ids[r, :prompts[r]], ids[lead, :prompts[lead]])
    # a group index that lies (two different prompts under one id) is not trusted
    lying = torch.zeros_like(groups)
    assert prefix_rows(ids, prompts, lying).num_prompts == 3
    assert prefix_rows(ids, prompts).num_prompts == 3


@pytest.mark.parametrize("config_cls, attn", [(LlamaConfig, "sdpa"), (Qwen2Config, "sdpa"), (LlamaConfig, "eager")])
def test_shared_prefix_logprobs_and_gradients_equal_the_padded_forward(config_cls, attn):
    model = _tiny(config_cls, attn)
    ids, prompts, completions, groups = _groups()
    prefix = prefix_rows(ids, prompts, groups)
    weights = torch.randn(ids.shape[0], int(completions.max()), generator=torch.Generator().manual_seed(1))
    results = []
    for shared in (None, prefix):
        model.zero_grad()
        out = sequence_logprobs(model, ids, prompts, completions, temperature=0.9, with_entropy=True, prefix=shared)
        (out.logprobs * weights).sum().backward()
        results.append((out.logprobs.detach(), out.entropy.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded_lp, padded_ent, padded_grad), (shared_lp, shared_ent, shared_grad) = results
    assert padded_lp.shape == shared_lp.shape == (ids.shape[0], int(completions.max()))
    torch.testing.assert_close(shared_lp, padded_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(shared_ent, padded_ent, atol=2e-5, rtol=0)
    mask = torch.arange(padded_lp.shape[1]) < completions.unsqueeze(1)
    assert torch.all(shared_lp[~mask] == 0) and torch.all(shared_lp[mask] < 0)
    for name, grad in padded_grad.items():
        torch.testing.assert_close(shared_grad[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_saves_the_repeated_prompt_passes():
    """The body sees each prompt once: token positions run = prompts + completions, not rows x (prompt + ...)."""
    model = _tiny(LlamaConfig)
    ids, prompts, completions, groups = _groups(num_groups=2, group_size=8)
    final_logit_transform(model)  # the once-per-model probe of its logits (two 8-token passes), not counted here
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        sequence_logprobs(model, ids, prompts, completions, prefix=prefix_rows(ids, prompts, groups))
    finally:
        hook.remove()
    assert seen == [2 * int(prompts.max()), ids.shape[0] * max(int(completions.max()), 1)]


def test_the_learner_step_shares_prefixes_when_groups_repeat_prompts():
    from learner.step import split_micro_batches
    from shared.protocol.records import TrainBatch

    ids, prompts, completions, groups = _groups(num_groups=2, group_size=4)
    batch = TrainBatch(
        input_ids=ids, prompt_lengths=prompts, completion_lengths=completions,
        behaviour_logprobs=torch.zeros(ids.shape[0], int(completions.max())), ref_logprobs=None,
        rewards=torch.zeros(ids.shape[0]), group_index=groups, policy_versions=torch.zeros(ids.shape[0],
                                                                                          dtype=torch.long),
        truncated=torch.zeros(ids.shape[0], dtype=torch.bool), temperature=1.0,
        reward_components={}, group_ids=["a", "b"], generator_ids=["g", "g"], batch_id="b")
    advantages = torch.zeros(ids.shape[0])
    auto = split_micro_batches(batch, advantages, 1, False, torch.device("cpu"), prefix_sharing="auto")
    assert auto[0].prefix is not None and auto[0].prefix.num_prompts == 2
    off = split_micro_batches(batch, advantages, 1, False, torch.device("cpu"), prefix_sharing="off")
    assert off[0].prefix is None
    # 'auto' leaves it off when packing was asked for, 'on' does not
    assert split_micro_batches(batch, advantages, 1, False, torch.device("cpu"), packing="packed",
                               prefix_sharing="auto")[0].prefix is None
    assert split_micro_batches(batch, advantages, 1, False, torch.device("cpu"), packing="packed",
                               prefix_sharing="on")[0].prefix is not None


def test_the_reference_scorer_shares_prefixes_with_the_same_results():
    from ref_server.scoring.scorer import ReferenceScorer, Row

    model = _tiny(Qwen2Config).eval()
    final_logit_transform(model)  # the once-per-model probe (done at load in the hub), not counted here
    ids, prompts, completions, _ = _groups(num_groups=2, group_size=6, seed=3)
    rows = [Row(ids[r, :int(prompts[r] + completions[r])].tolist(), int(prompts[r])) for r in range(len(ids))]
    results, passes = {}, {}
    for mode in ("off", "on"):
        seen = []
        hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out, seen=seen: seen.append(1))
        scorer = ReferenceScorer(model, vocab_size=VOCAB, max_context=64, packing="padded", prefix_sharing=mode)
        try:
            results[mode] = scorer.score(rows, temperature=1.0, timeout=60)
        finally:
            scorer.close()
            hook.remove()
        passes[mode] = len(seen)
    assert passes == {"off": 1, "on": 2}  # one padded pass; the prompts' pass and the completions' pass
    for off, on, n in zip(results["off"], results["on"], completions.tolist()):
        assert off.shape == on.shape == (n,)
        torch.testing.assert_close(on, off, atol=2e-5, rtol=0)
