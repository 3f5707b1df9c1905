"""A teacher of another size and architecture than the student (issue 42 item 1): only the tokenizer must be the
same. The hub scores each group with it and the batch carries its logprobs as the teacher model computes them."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from deploy.demo.tiny_model import build_char_tokenizer
from ref_server.scoring.teacher import check_same_tokenizer
from tests.live_server import LiveServer, make_config

from .helpers import make_group
from .test_teacher import PINNED, _logprobs


def qwen2(tokenizer):   # deeper and wider than the tiny Llama student (2 x 192), grouped-query attention
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=3,
                                        num_attention_heads=8, num_key_value_heads=2, intermediate_size=384,
                                        max_position_embeddings=256, tie_word_embeddings=False,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def gpt2(tokenizer):    # learned absolute positions, no rotary embedding, another module layout
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=3, n_head=4, n_positions=256,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


@pytest.mark.slow   # a live hub
@pytest.mark.parametrize("build", [qwen2, gpt2], ids=["qwen2", "gpt2"])
def test_a_teacher_of_another_architecture_scores_each_group_as_it_computes(tmp_path, tiny_model_dir, build):
    tokenizer = build_char_tokenizer()
    torch.manual_seed(5)
    teacher_dir = tmp_path / "teacher"
    build(tokenizer).eval().save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    check_same_tokenizer(str(tiny_model_dir), str(teacher_dir))   # the one requirement
    with LiveServer(make_config(tmp_path, tiny_model_dir, teacher_model=str(teacher_dir), beta=0.04,
                                **PINNED)) as live:
        live.state.hub.report_version(0)
        groups = [make_group(seed=11), make_group(seed=12, prompt=(5,), lengths=(6, 1, 3, 2))]
        for group in groups:
            live.state.hub.put(group.to_bytes())
        batch = live.state.hub.take(2, timeout=60)
    assert batch is not None and batch.teacher_logprobs is not None and sorted(batch.group_ids) == sorted(
        g.group_id for g in groups)
    for group in groups:   # each group's rows, where the batch put the group
        prompt = group.prompt_ids.tolist()
        rows = [prompt + group.completion_ids[i, :int(n)].tolist() for i, n in enumerate(group.completion_lengths)]
        first = batch.group_ids.index(group.group_id) * len(rows)
        teacher, student = _logprobs(teacher_dir, rows, len(prompt)), _logprobs(tiny_model_dir, rows, len(prompt))
        for i, (want, reference) in enumerate(zip(teacher, student)):
            torch.testing.assert_close(batch.teacher_logprobs[first + i, :want.numel()], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(batch.ref_logprobs[first + i, :want.numel()], reference, atol=1e-5, rtol=0)
            assert not torch.allclose(want, reference, atol=1e-3)   # another model: other numbers
