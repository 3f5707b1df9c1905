"""A tiny untrained process reward model in Qwen2.5-Math-PRM's layout, built locally in a second (nothing is
downloaded): a character tokenizer with ``<extra_0>``, ``<|im_start|>`` and ``<|im_end|>`` as special tokens and
a ChatML chat template (Qwen2.5's), and a 2-layer ``LlamaForTokenClassification`` with 2 labels (Llama, not Qwen2:
transformers 5 loads a ``qwen2`` folder's tokenizer as ``Qwen2Tokenizer``, whose splitting eats the newline before
a special token in this character vocabulary).

For tests and for trying the ``prm`` reward without a GPU (``ref_server.prm_model``); its step rewards are
those of random weights. ``python -m ref_server.tool_api.prm_tiny OUT_DIR`` writes one.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<pad>", "<unk>", "<extra_0>", "<|im_start|>", "<|im_end|>")


def build_tiny_prm_tokenizer():
    """One token per printable ASCII character (and newline); the special tokens are one token each."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # "[\s\S]" rather than ".": Oniguruma's "." does not match "\n", and newlines must survive
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # stated in full: a special token saved with the defaults comes back stripping the whitespace next to it
    tok.add_special_tokens([AddedToken(t, lstrip=False, rstrip=False, normalized=False, single_word=False,
                                       special=True) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[2:]),
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_prm(out_dir: str | Path, seed: int = 0) -> Path:
    """Save the tiny PRM (model + tokenizer) to ``out_dir`` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForTokenClassification

    tokenizer = build_tiny_prm_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, num_labels=2,
                         pad_token_id=tokenizer.pad_token_id, initializer_range=0.3)
    torch.manual_seed(seed)
    # a wide initialisation so the two classes' probabilities differ from token to token (not all ~0.5)
    model = LlamaForTokenClassification(config).eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes tokenizer_class "TokenizersBackend", a name transformers 4 (which vLLM may pin) lacks
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ref_server.tool_api.prm_tiny OUT_DIR")
    print(build_tiny_prm(sys.argv[1]))
