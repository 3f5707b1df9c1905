"""The parent's side of the code sandbox: split each test into what must run next to the solution and what
the parent checks itself, then decide the verdict from plain values only.

A test is one or more top-level statements. Non-``assert`` statements run in the sandbox. Each ``assert``
expression is walked here: literals, containers, arithmetic, comparisons, ``and``/``or``/``not``, subscripts
and calls of a few pure built-ins (``len``, ``sorted``, ``set``, ``abs``, ``math.isclose``...) are evaluated
by the parent; every other sub-expression (a call of the solution's function, a variable) is a *leaf* whose
value the sandbox reports. So for ``assert f(2) == 4`` the sandbox is asked for ``f(2)`` only and never
sees ``4``. A leaf that needs no solution (only built-in names, e.g. ``[i * i for i in range(3)]``) is
evaluated before the solution is loaded. Values cross as JSON with exact built-in types (see
``generator/sandbox/child.py``'s ``encode``) and are rebuilt here as plain objects, so every comparison runs on ``int``,
``float``, ``str``, ``list``... and never calls code the policy wrote. ``isinstance(x, <built-in type>)`` is
checked here too.

Comparisons follow Python on those plain values: ``4.0 == 4`` and ``True == 1`` hold, as they would if the
dataset's asserts ran normally; ``(1, 2) == [1, 2]`` does not. Unsupported (the test fails, with the reason
in the detail): an ``assert`` nested in a block (``for``/``def``/``with``...), a test without any ``assert``
(nothing the solution cannot forge), ``is`` against anything but ``None``/``True``/``False``, and a comparison
or truth test inside an expression the sandbox evaluates (``all([f(x) == x for x in xs])``: an always-equal
object would make every element True).
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
from dataclasses import dataclass, field

_SAFE_CALLS = {"abs": abs, "len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "list": list,
               "tuple": tuple, "sum": sum, "min": min, "max": max, "round": round, "bool": bool, "any": any,
               "all": all, "dict": dict, "str": str, "int": int, "float": float}
_SAFE_MATH = {"isclose": math.isclose, "fabs": math.fabs, "floor": math.floor, "ceil": math.ceil}
_SAFE_KEYWORDS = {"reverse", "rel_tol", "abs_tol", "ndigits"}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_SAFE_TYPES = {"int": int, "float": float, "complex": complex, "str": str, "bytes": bytes, "bool": bool,
               "list": list, "tuple": tuple, "dict": dict, "set": set, "frozenset": frozenset}
# Inside an expression the sandbox evaluates, these would turn the solution's objects into truth values it
# controls (an always-equal object makes ``[f(x) == x for x in xs]`` all True), so such tests are refused.
_TRUTH_NODES = (ast.Compare, ast.BoolOp, ast.IfExp)
_TRUTH_CALLS = frozenset({"isinstance", "issubclass", "callable", "hasattr", "all", "any", "bool"})
_SINGLETONS = (None, True, False)
_MAX_SIZE = 10**6
_BUILTIN_NAMES = frozenset(dir(builtins))


class Unsupported(ValueError):
    """A test whose form the parent cannot check without trusting the sandbox; it is scored as failed."""


class LeafError(Exception):
    """A leaf the sandbox did not value: it raised, was not plain data, was reported twice, or never came."""


@dataclass
class CompiledTest:
    """One test: ``steps`` for the sandbox (("exec", src) or ("eval", leaf_id, src)), ``asserts`` for here."""

    source: str
    steps: list[list] = field(default_factory=list)
    asserts: list[ast.expr] = field(default_factory=list)
    leaves: dict[int, int] = field(default_factory=dict)    # id(ast node) -> leaf id
    pure: dict[int, str] = field(default_factory=dict)      # leaf id -> source, for phase 0
    error: str | None = None


def _is_parent_node(node: ast.AST, leaves: dict[int, int], make_leaf, shadowed: frozenset[str]) -> None:
    """Walk ``node``; sub-expressions the parent can evaluate are recursed into, the rest become leaves."""
    if isinstance(node, ast.Constant):
        return
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
        children = node.elts
    elif isinstance(node, ast.Dict) and None not in node.keys:
        children = [*node.keys, *node.values]
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        children = [node.operand]
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        children = [node.left, node.right]
    elif isinstance(node, ast.BoolOp):
        children = node.values
    elif isinstance(node, ast.Compare):
        _check_identity(node)
        children = [node.left, *node.comparators]
    elif isinstance(node, ast.Subscript):
        index = node.slice
        children = [node.value, *(p for p in (index.lower, index.upper, index.step) if p)] \
            if isinstance(index, ast.Slice) else [node.value, index]
    elif _safe_call(node, shadowed) is not None:
        children = [*node.args, *(k.value for k in node.keywords)]
    elif _type_check(node, shadowed):
        children = [node.args[0]]
    else:
        leaves[id(node)] = make_leaf(node)
        return
    for child in children:
        _is_parent_node(child, leaves, make_leaf, shadowed)


def _check_identity(node: ast.Compare) -> None:
    """``is``/``is not`` only make sense for singletons once values are copied: ``x is None`` is supported."""
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        if isinstance(op, (ast.Is, ast.IsNot)):
            pair = operands[i], operands[i + 1]
            if not any(isinstance(o, ast.Constant) and o.value in _SINGLETONS and type(o.value) in (bool, type(None))
                       for o in pair):
                raise Unsupported("'is' against something other than None/True/False")


def _safe_call(node: ast.AST, shadowed: frozenset[str]):
    """The pure built-in a call names (``len(...)``, ``math.isclose(...)``), or None; a name the solution
    or the test binds itself (a task asking for a function called ``sum``) is not the built-in."""
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    if any(k.arg not in _SAFE_KEYWORDS for k in node.keywords):
        return None
    func = node.func
    if isinstance(func, ast.Name) and func.id not in shadowed:
        return _SAFE_CALLS.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math" \
            and "math" not in shadowed:
        return _SAFE_MATH.get(func.attr)
    return None


def _type_check(node: ast.AST, shadowed: frozenset[str]) -> bool:
    """``isinstance(x, int)`` / ``isinstance(x, (list, tuple))`` with built-in types: checked here on the
    plain value (in the sandbox an object could fake its ``__class__``)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and "isinstance" not in shadowed and len(node.args) == 2 and not node.keywords):
        return False
    spec = node.args[1]
    names = spec.elts if isinstance(spec, ast.Tuple) else [spec]
    return all(isinstance(n, ast.Name) and n.id in _SAFE_TYPES and n.id not in shadowed for n in names)


def _check_leaf(node: ast.expr) -> None:
    """Refuse a leaf that would compute a truth value from the solution's objects inside the sandbox."""
    for sub in ast.walk(node):
        if isinstance(sub, _TRUTH_NODES) or (isinstance(sub, ast.UnaryOp) and isinstance(sub.op, ast.Not)) or (
                isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in _TRUTH_CALLS):
            raise Unsupported(f"unsupported test form: '{ast.unparse(sub)[:80]}' inside '{ast.unparse(node)[:80]}' "
                              "would be computed next to the solution; compare at the top level of the assert")


def _free_names(node: ast.AST) -> set[str]:
    """Names an expression reads that it does not bind itself (comprehension targets, lambda arguments)."""
    loaded, bound = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loaded if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
        elif isinstance(sub, ast.arg):
            bound.add(sub.arg)
    return loaded - bound


def bound_names(tree: ast.AST) -> set[str]:
    """Every name a piece of code binds anywhere (assignments, defs, classes, imports, arguments)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def compile_tests(code: str, sources: list[str]) -> list[CompiledTest]:
    """Compile every test of one run; leaf ids are unique across them. A built-in name the solution binds
    (parsed here, not reported by the sandbox) is not evaluated by the parent."""
    try:
        solution_names = bound_names(ast.parse(code))
    except (SyntaxError, ValueError):
        solution_names = set()          # the sandbox reports the solution's own error
    counter = iter(range(10**9))
    return [compile_test(source, counter, solution_names) for source in sources]


def compile_test(source: str, counter, solution_names: set[str]) -> CompiledTest:
    """Split one test's source into sandbox steps and parent-side asserts; ``Unsupported`` is recorded."""
    test = CompiledTest(source)
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        test.error = f"unsupported test (does not parse: {exc})"
        return test
    shadowed = frozenset(bound_names(module) | solution_names)

    def make_leaf(node: ast.expr) -> int:
        leaf, text = next(counter), ast.unparse(node)
        names = _free_names(node)
        if names <= _BUILTIN_NAMES and not names & shadowed:
            test.pure[leaf] = text
        else:
            _check_leaf(node)
            test.steps.append(["eval", leaf, text])
        return leaf

    try:
        for stmt in module.body:
            if isinstance(stmt, ast.Assert):
                _is_parent_node(stmt.test, test.leaves, make_leaf, shadowed)
                test.asserts.append(stmt.test)
            elif any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                raise Unsupported(f"unsupported test form: assert inside a '{type(stmt).__name__}' block")
            else:
                test.steps.append(["exec", ast.unparse(stmt)])
        if not test.asserts:
            raise Unsupported("unsupported test form: no assert (nothing to check outside the sandbox)")
    except Unsupported as exc:
        test.error, test.steps, test.pure = str(exc), [], {}
    return test


def decode(data: object, depth: int = 0) -> object:
    """Rebuild a value from the sandbox's JSON, accepting exact plain types only (else ValueError)."""
    if depth > 100:
        raise ValueError("value nested too deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"malformed value {str(data)[:80]!r}")
    (tag, body), = data.items()
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
        return complex(*body)
    if tag in ("list", "tuple", "set", "frozenset") and type(body) is list:
        items = [decode(x, depth + 1) for x in body]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    raise ValueError(f"malformed value tag {tag!r}")


def _guarded_binary(op: ast.operator, left: object, right: object) -> object:
    """Arithmetic on plain values, refusing results big enough to hurt the parent (``'a' * 10**12``)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) \
            and left.bit_length() * abs(right) > 64 * _MAX_SIZE:
        raise OverflowError("power too large to check")
    if isinstance(op, ast.Mult):
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int) and len(seq) * times > _MAX_SIZE:
                raise OverflowError("sequence too large to check")
    return _BINARY[type(op)](left, right)


def evaluate(node: ast.expr, test: CompiledTest, values: dict[int, object]) -> object:
    """Evaluate an assert expression here; leaves come from ``values`` (a LeafError stored there is raised)."""
    leaf = test.leaves.get(id(node))
    if leaf is not None:
        value = values.get(leaf, LeafError("no value reported (the sandbox ended first)"))
        if isinstance(value, LeafError):
            raise value
        return value

    def ev(child: ast.expr) -> object:
        return evaluate(child, test, values)

    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](ev(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp):
        return _guarded_binary(node.op, ev(node.left), ev(node.right))
    if isinstance(node, ast.BoolOp):
        return _bool_op(node, ev)
    if isinstance(node, ast.Compare):
        return _compare(node, ev)
    if isinstance(node, ast.Subscript):
        index = node.slice
        if isinstance(index, ast.Slice):
            parts = [ev(p) if p is not None else None for p in (index.lower, index.upper, index.step)]
            return ev(node.value)[slice(*parts)]
        return ev(node.value)[ev(index)]
    if _type_check(node, frozenset()):
        spec = node.args[1]
        names = spec.elts if isinstance(spec, ast.Tuple) else [spec]
        return isinstance(ev(node.args[0]), tuple(_SAFE_TYPES[n.id] for n in names))
    return _safe_call(node, frozenset())(*(ev(a) for a in node.args), **{k.arg: ev(k.value) for k in node.keywords})


def _bool_op(node: ast.BoolOp, ev) -> object:
    """``and``/``or`` with Python's short-circuit: a leaf that is never needed cannot fail the test."""
    value = None
    for operand in node.values:
        value = ev(operand)
        if bool(value) != isinstance(node.op, ast.And):
            return value
    return value


def _compare(node: ast.Compare, ev) -> bool:
    """Chained comparisons, left to right, stopping at the first false one like Python."""
    left = ev(node.left)
    for op, right_node in zip(node.ops, node.comparators):
        right = ev(right_node)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True


def judge(test: CompiledTest, values: dict[int, object], test_error: str | None) -> str | None:
    """None if every assert of the test holds on the reported values, else why it failed."""
    if test.error:
        return test.error
    if test_error:
        return test_error
    for node in test.asserts:
        try:
            ok = bool(evaluate(node, test, values))
        except LeafError as exc:
            return f"{ast.unparse(node)}: {exc}"
        except (ArithmeticError, TypeError, ValueError, LookupError, RecursionError) as exc:
            return f"{ast.unparse(node)}: {type(exc).__name__}: {exc}"
        if not ok:
            got = evaluate(node.left, test, values) if isinstance(node, ast.Compare) else None
            return f"assert {ast.unparse(node)} failed" + (f" (left side: {got!r:.80})" if got is not None else "")
    return None
