"""What a model's ``forward`` does to its LM head's output, found and checked on the model itself.

The chunked logprobs (:mod:`shared.forward.logprobs`, the ref server's top-k, the top-k distillation head) run the
model's body and apply the LM head themselves, so anything the architecture's ``forward`` does between the two
must be done here too, or every logprob is silently wrong. Architectures differ: Gemma 2/3 and NanoChat soft-cap
the logits (``final_logit_softcapping``), RecurrentGemma too (``logits_soft_cap``), Cohere multiplies them
(``logit_scale``), Falcon-H1 as well (``lm_head_multiplier``), Granite divides them (``logits_scaling``;
MiniCPM3 divides the hidden states by it, the same for a bias-free head), and a multimodal wrapper may or may not
apply its text config's.

Reading config fields alone guesses; a model the project never saw, or one whose wrapper ignores a field its text
config has, would get wrong numbers without a word. So :func:`final_logit_transform` probes each model once (then
caches): the model's own ``forward`` logits on a few tokens against ``head(body(...))`` under each candidate the
config names (the top-level config's fields, the text config's, none), and keeps the candidate whose log-softmax
matches. A model that none matches is refused with :class:`UnsupportedHeadError`, naming the architecture and the
gap, rather than trained or scored with logprobs that are not its own.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from shared.errors import UsageError
from shared.forward.model_parts import head_vocab_size, probing, split_model

log = logging.getLogger("grpo.forward")

# where each scaling lives in a config: (field, how it acts on the logits)
MULTIPLY_FIELDS = ("logit_scale", "lm_head_multiplier")
DIVIDE_FIELDS = ("logits_scaling",)
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap")
PROBE_TOKENS = 8


class UnsupportedHeadError(UsageError):
    """A model whose ``forward`` turns the LM head's output into logits in a way this project does not reproduce."""


@dataclass(frozen=True)
class LogitTransform:
    """``softcap * tanh(logits * multiply / divide / softcap)`` (each part only when set), applied to the LM head's
    output in fp32."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def is_identity(self) -> bool:
        return self.multiply is None and self.divide is None and self.softcap is None


def transform_from_config(config) -> LogitTransform:
    """The scalings ``config`` names (the first field of each kind that is set and not a no-op)."""

    def first(fields: tuple[str, ...], neutral: float | None) -> float | None:
        for field in fields:
            value = getattr(config, field, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value != neutral:
                return float(value)
        return None

    return LogitTransform(multiply=first(MULTIPLY_FIELDS, 1.0), divide=first(DIVIDE_FIELDS, 1.0),
                          softcap=first(SOFTCAP_FIELDS, None))


def candidate_transforms(model: nn.Module) -> list[LogitTransform]:
    """In order of preference: what the model's config names, what its text config names, none (distinct ones).
    The probe keeps the first that matches, so where it cannot tell them apart (logits too small for a soft cap to
    show) the config's own fields win."""
    config = getattr(model, "config", None)
    configs = [config]
    if callable(getattr(config, "get_text_config", None)):
        try:
            configs.append(config.get_text_config())
        except (ValueError, AttributeError):  # a composite config with no text part, or an odd one
            pass
    found: list[LogitTransform] = []
    for candidate in [*(transform_from_config(c) for c in configs if c is not None), LogitTransform()]:
        if candidate not in found:
            found.append(candidate)
    return found


_found: weakref.WeakKeyDictionary[nn.Module, LogitTransform] = weakref.WeakKeyDictionary()


def final_logit_transform(model: nn.Module) -> LogitTransform | None:
    """The transform of ``model``'s LM head output into its logits (None: the head's output as it is), probed on
    the model once and cached; raises :class:`UnsupportedHeadError` when no candidate reproduces its logits."""
    if model not in _found:
        _found[model] = probe_logit_transform(model)
    found = _found[model]
    return None if found.is_identity else found


def named_token_ids(model: nn.Module) -> set[int]:
    """Every id the model's config (and its text config) names in a ``*token_id``/``*token_index`` field."""
    named: set[int] = set()
    config = getattr(model, "config", None)
    for each in (config, getattr(config, "text_config", None)):
        for key, value in getattr(each, "__dict__", {}).items():  # a sub-config may be absent or a plain dict
            if key.endswith(("token_id", "token_index", "token_ids")):
                named.update(v for v in (value if isinstance(value, (list, tuple)) else [value])
                             if isinstance(v, int) and not isinstance(v, bool))
    return named


def probe_ids(vocab: int, avoid: set[int]) -> list[int]:
    """Up to :data:`PROBE_TOKENS` distinct ids in ``[0, vocab)``, spread over the vocabulary, none in ``avoid``
    (an image token would ask a multimodal model for pixels): a stride coprime with ``vocab`` visits every id."""
    stride = next(p for p in (7919, 104729, 1299709) if math.gcd(p, vocab) == 1)
    ids: list[int] = []
    for j in range(vocab):
        token = (vocab // 3 + j * stride) % vocab
        if token not in avoid:
            ids.append(token)
            if len(ids) == PROBE_TOKENS:
                break
    return ids


def probe_logit_transform(model: nn.Module) -> LogitTransform:
    """Run ``model`` and ``head(body(...))`` on a few tokens and return the candidate transform
    (:func:`candidate_transforms`) whose log-softmax matches the model's own, to a tolerance of its dtype.

    A model whose probe cannot run (a forward that wants more than token ids) keeps its config's transform, with a
    warning; a partitioned ZeRO-3 model is probed like any other (every rank runs the same calls)."""
    candidates = candidate_transforms(model)
    body, head = split_model(model)
    param = next(model.parameters())
    vocab = int(head_vocab_size(head) or 0)
    if vocab < 2:
        return candidates[0]
    chosen = probe_ids(vocab, named_token_ids(model))
    if not chosen:
        return candidates[0]
    ids = torch.tensor([chosen], device=param.device)
    try:
        with probing(model):
            want = model(input_ids=ids, use_cache=False).logits[0].float()
            raw = head(body(input_ids=ids, use_cache=False).last_hidden_state)[0].float()
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        log.warning("%s: could not probe how its forward makes logits (%s); using its config's (%s)",
                    type(model).__name__, exc, candidates[0])
        return candidates[0]
    name = f"{type(model).__name__} ({getattr(getattr(model, 'config', None), 'model_type', '?')})"
    if want.shape != raw.shape:
        raise UnsupportedHeadError(
            f"{name}: its forward returns {tuple(want.shape)} logits for {len(chosen)} tokens where its LM head "
            f"gives {tuple(raw.shape)}: the chunked logprobs (which apply the head themselves) cannot reproduce it")
    if not (torch.isfinite(want).all() and torch.isfinite(raw).all()):
        raise UnsupportedHeadError(f"{name}: its logits on {len(chosen)} probe tokens are not finite (NaN or inf "
                                   "weights?): it cannot be trained or scored")
    target = torch.log_softmax(want, dim=-1)
    gaps = [float((torch.log_softmax(c(raw), dim=-1) - target).abs().max()) for c in candidates]
    # fp32 agrees to rounding; bf16/fp16 round the head's output and a transform applied in that dtype by forward
    rounding = 1e-4 if param.dtype == torch.float32 else 2.0 ** -6
    tolerance = 1e-3 + rounding * float(want.abs().max())
    matching = [i for i, gap in enumerate(gaps) if gap <= tolerance]
    if not matching:
        tried = "; ".join(f"{c}: {g:.3g}" for c, g in zip(candidates, gaps))
        raise UnsupportedHeadError(
            f"{name}: its forward's logits are not its LM head's output under any scaling its config names "
            f"(largest logprob gap per candidate, nats: {tried}; tolerance {tolerance:.3g}): the chunked logprobs "
            "(learner, reference and teacher scoring) would differ from the model's own, so it is refused")
    best = matching[0]
    if not candidates[best].is_identity:
        log.info("%s: logits are %s of the LM head's output (probed)", name, candidates[best])
    return candidates[best]
