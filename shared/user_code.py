"""Code a user names in a config: ``package.module:attr`` or ``path/to/file.py:attr``.

One home for loading a user's reward function, environment class or tool: every config field that names user
code goes through :func:`load_object`, so every one of them accepts both spellings and fails the same way, with a
:class:`~shared.errors.UsageError` that names the config key and what was wrong (never a bare ImportError
traceback). :func:`check_callable` checks a loaded function against the calling convention the caller documents,
so a wrong signature stops the run at start-up instead of scoring every completion 0.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.errors import UsageError

__all__ = ["check_callable", "check_keyword_args", "load_object", "split_spec"]


def split_spec(spec: str, key: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of ``spec``; a UsageError naming ``key`` when it is not ``X:attr``."""
    if not isinstance(spec, str):
        raise UsageError(f"{key}: expected 'module:name' or 'path/to/file.py:name', got {spec!r}")
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr or not attr.replace(".", "_").isidentifier():
        raise UsageError(f"{key}: expected 'module:name' or 'path/to/file.py:name', got {spec!r}")
    return source, attr


def _is_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source or "\\" in source


def _load_file(path: Path, key: str) -> Any:
    if not path.is_file():
        raise UsageError(f"{key}: no such file {path}")
    # one module per resolved path: two configs naming the same file share it; the name cannot clash with a package
    name = "grpo_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{key}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in the user's file is reported with its key and file
        del sys.modules[name]
        raise UsageError(f"{key}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_object(spec: str, key: str, *, base_dir: str | Path | None = None) -> Any:
    """The object ``spec`` names.

    ``spec`` is ``package.module:attr`` (importable from ``sys.path``) or ``path/to/file.py:attr`` (a relative path
    is taken from ``base_dir``, else the working directory). ``attr`` may be dotted (``Class.method``). ``key`` is
    the config key that named it, used in every error."""
    source, attr = split_spec(spec, key)
    if _is_file(source):
        path = Path(source).expanduser()
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = Path(base_dir) / path
        module = _load_file(path, key)
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as exc:
            raise UsageError(f"{key}: cannot import module {source!r} ({exc}); name a file instead, e.g. "
                             f"'path/to/{source.rsplit('.', 1)[-1]}.py:{attr}', or add its folder to PYTHONPATH") from None
        except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
            raise UsageError(f"{key}: importing {source!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = getattr(module, "__file__", source)
            raise UsageError(f"{key}: {where} has no {attr!r}") from None
    return obj


def check_callable(fn: Any, key: str, *, keywords: Iterable[str], contract: str, extra: Iterable[str] = ()) -> None:
    """Raise a UsageError naming ``key`` unless ``fn`` can be called with exactly the keyword arguments
    ``keywords`` plus ``extra`` (config-supplied keyword arguments). ``contract`` is the documented signature,
    shown in the error."""
    if not callable(fn):
        raise UsageError(f"{key}: {fn!r} is not callable; expected {contract}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function without a signature: it will be checked by its first call
    names = {name: None for name in (*keywords, *extra)}
    try:
        signature.bind(**names)
    except TypeError as exc:
        raise UsageError(f"{key}: {getattr(fn, '__qualname__', fn)}{signature} cannot be called as {contract} "
                         f"({exc})") from None


def check_keyword_args(target: Any, args: dict[str, Any], key: str) -> None:
    """Raise a UsageError naming ``key`` unless ``target`` (a class: its constructor) can be called with ``args``
    as keyword arguments: an unknown name is named with the names it takes (and the closest one), a missing
    required one too. Checked at start-up: a typo in args otherwise failed every trajectory at run time."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # no signature to check against: its first call checks
    params = signature.parameters.values()
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and not p.name.startswith("_")]
    what = getattr(target, "__qualname__", repr(target))
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [name for name in args if name not in takes]
        if unknown:
            close = difflib.get_close_matches(unknown[0], takes, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{key}: unknown argument {unknown[0]!r}{hint}; {what} takes "
                             f"{', '.join(takes) if takes else 'no arguments'}")
    try:
        signature.bind(**args)
    except TypeError as exc:
        raise UsageError(f"{key}: {what}{signature} cannot be called with {sorted(args)} ({exc})") from None
