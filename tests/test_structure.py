"""The shape of the product code (ARCHITECTURE.md): no import circles, files under 400 lines, functions under 60,
and shared/ importing no service.

The import graph is built with ``ast`` from every import statement, at module level and inside functions alike (an
import moved into a function still is a dependency; ``if TYPE_CHECKING:`` imports count too). ``from x import y``
is an edge to ``x.y`` where that is a module, else to ``x``; ``import a.b`` is an edge to ``a.b``. Only modules of
the product packages are nodes. Each failure prints what to fix.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "ref_server", "generator", "learner", "deploy", "grpo_stack")
SERVICES = ("ref_server", "generator", "learner", "deploy", "grpo_stack")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def is_parser_builder(name: str) -> bool:
    """Declarative argument parsers (one ``add_argument`` per flag) may be long."""
    return name == "build_parser" or name.endswith("_parser")


@cache
def product_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the product packages (a package is its __init__.py)."""
    modules = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


@cache
def syntax_tree(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks."""
    return ast.parse(path.read_text(), str(path))


def _known(name: str) -> str | None:
    """``name`` or its longest prefix that is a product module."""
    modules = product_modules()
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _imported(module: str, path: Path) -> set[str]:
    """The product modules that ``module`` (in file ``path``) imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.Import):
            targets.update(_known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                targets.add(_known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in product_modules()
                            else _known(base))
    return {t for t in targets if t is not None and t != module}


@cache
def import_graph() -> dict[str, set[str]]:
    return {module: _imported(module, path) for module, path in product_modules().items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, those of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _report(title: str, offenders: list[str]) -> str:
    text = f"{title}:\n" + "\n".join(f"  {line}" for line in offenders)
    print(text)
    return text


def test_no_import_circles_among_the_product_packages():
    graph = import_graph()
    circles = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        circles.append(f"{', '.join(component)}  ({'; '.join(edges)})")
    assert not circles, _report("import circles (strongly connected modules, with their edges)", circles)


def test_no_product_file_is_over_400_lines():
    long_files = []
    for path in product_modules().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long_files, _report(f"files over {MAX_FILE_LINES} lines", long_files)


def test_no_product_function_is_over_60_lines():
    long_functions = []
    for path in product_modules().values():
        for node in ast.walk(syntax_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_parser_builder(node.name):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long_functions, _report(f"functions over {MAX_FUNCTION_LINES} lines", long_functions)


def test_shared_imports_nothing_from_the_services():
    offenders = [f"{module} -> {target}" for module, targets in sorted(import_graph().items())
                 if module.split(".")[0] == "shared"
                 for target in sorted(targets) if target.split(".")[0] in SERVICES]
    assert not offenders, _report("shared/ importing a service", offenders)


def test_the_graph_sees_lazy_relative_and_submodule_imports():
    """The checks above are only as good as the graph: spot-check edges of each kind of import statement."""
    graph = import_graph()
    assert "generator.stats" in graph["generator.progress"]          # from generator.stats import LoopStats
    assert "deploy.launcher" in graph["deploy.cli"]                  # inside cmd_run
    assert "deploy.demo.warmup" in graph["deploy.demo.tiny_model"]   # module level, from a package
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- one home for masks, one plug-in style (issue 35) ---------------------------------------------------------------
def _package_edges(source: str, target: str) -> list[str]:
    """The import edges from modules of package ``source`` into package ``target``."""
    inside = lambda module, package: module == package or module.startswith(package + ".")  # noqa: E731
    return [f"{module} -> {imported}" for module, targets in sorted(import_graph().items()) if inside(module, source)
            for imported in sorted(targets) if inside(imported, target)]


def test_the_math_and_the_forward_do_not_import_each_other():
    """Their common helpers (masks, device moves) live on the ground floor, shared/tensors/."""
    edges = _package_edges("shared.grpo", "shared.forward") + _package_edges("shared.forward", "shared.grpo")
    assert not edges, _report("imports between shared/grpo and shared/forward", edges)


def test_the_math_imports_no_wire_module():
    edges = _package_edges("shared.grpo", "shared.protocol")
    assert not edges, _report("shared/grpo importing shared/protocol", edges)


def test_the_tensor_ground_floor_imports_nothing_of_the_product():
    edges = [edge for package in ("shared", *SERVICES) for edge in _package_edges("shared.tensors", package)
             if not edge.split(" -> ")[1].startswith("shared.tensors")]
    assert not edges, _report("shared/tensors importing the product (it may import torch only)", edges)


def _mask_comparisons(tree: ast.AST) -> list[int]:
    """Lines of ``x < lengths.unsqueeze(1)`` (or ``.reshape(-1, 1)``): a mask from lengths written out."""
    def column(node: ast.AST) -> bool:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return False
        args = [a.value if isinstance(a, ast.Constant) else ast.unparse(a) for a in node.args]
        return (node.func.attr, args) in (("unsqueeze", [1]), ("reshape", ["-1", 1]), ("view", ["-1", 1]))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and [type(op) for op in node.ops] == [ast.Lt] and column(node.comparators[0])]


def test_masks_from_lengths_are_built_in_one_place():
    """``shared.tensors.masks.completion_mask`` (or ``lengths_to_mask``), not ``arange(w) < lengths.unsqueeze(1)``."""
    home = ROOT / "shared" / "tensors" / "masks.py"
    written = [f"{path.relative_to(ROOT)}:{line}" for path in product_modules().values() if path != home
               for line in _mask_comparisons(syntax_tree(path))]
    assert not written, _report("masks from lengths written out (use shared.tensors.masks.completion_mask)", written)
    assert _mask_comparisons(ast.parse("m = torch.arange(w) < n.unsqueeze(1)\nk = a < b.reshape(-1, 1)")) == [1, 2]


def _registries() -> dict[str, str]:
    """Every ``NAME = Registry(...)`` of the product: name -> the module defining it."""
    found = {}
    for module, path in product_modules().items():
        for node in syntax_tree(path).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            if (isinstance(target, ast.Name) and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id == "Registry"):
                found[target.id] = module
    return found


def test_every_registry_is_dispatched_and_checked_at_config_load():
    """The one plug-in style (shared/registry.py): an entry is dispatched by ``NAME.get(name)`` in product code, and
    the config field naming it is checked at load by ``check_registered("<its module>", "NAME", ...)``."""
    registries = _registries()
    assert {"ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "AGGREGATIONS", "REWARDS", "ENVIRONMENTS",
            "DATASETS", "SUPERVISIONS"} <= set(registries), sorted(registries)
    dispatched, checked = set(), set()
    for path in product_modules().values():
        for node in ast.walk(syntax_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Name):
                dispatched.add(func.value.id)
            if (isinstance(func, ast.Name) and func.id == "check_registered" and len(node.args) >= 2
                    and all(isinstance(a, ast.Constant) for a in node.args[:2])):
                checked.add((node.args[0].value, node.args[1].value))
    unread = [f"{name} ({module}): no {name}.get(...) in product code" for name, module in sorted(registries.items())
              if name not in dispatched]
    unchecked = [f"{name} ({module}): no check_registered('{module}', '{name}', ...) in the config schema"
                 for name, module in sorted(registries.items())
                 if not any(n == name and (module == m or module.startswith(m + ".")) for m, n in checked)]
    assert not unread + unchecked, _report("registries not dispatched or not checked at config load",
                                           unread + unchecked)


# -- every process speaks the hub's protocol through one client ---------------------------------------------------
# The modules that talk HTTP: the hub's clients (their retries, token, learner session and error handling in one
# place) and wait_healthy, which polls a starting service's /healthz.
HTTP_CLIENT_MODULES = {"shared.protocol.client", "shared.protocol.scorer_client", "shared.protocol.health"}
# Product modules that talk HTTP to something that is not the hub, so not through its client.
HTTP_ELSEWHERE = {
    "generator.rewards.builtin": "the http reward posts each group to the user's own reward service",
    "generator.rewards.prm": "the PRM reward calls a process reward model's /pooling endpoint (vLLM's API)",
}


def raw_http_uses(path: Path) -> list[str]:
    """Where a module uses ``requests`` (an import, ``requests.x``) or calls a client's ``_request``, as
    'line: what'."""
    found = []
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "requests" for a in node.names):
            found.append(f"{node.lineno}: import requests")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "requests" and not node.level:
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "requests":
            found.append(f"{node.lineno}: requests.{node.attr}")
        elif isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "_request"
                                             or getattr(node.func, "id", None) == "_request"):
            found.append(f"{node.lineno}: _request(...)")
    return sorted(found, key=lambda use: int(use.partition(":")[0]))


def test_only_the_clients_talk_http():
    offenders = [f"{path.relative_to(ROOT)}:{use}" for module, path in product_modules().items()
                 if module not in HTTP_CLIENT_MODULES and module not in HTTP_ELSEWHERE
                 for use in raw_http_uses(path)]
    assert not offenders, _report("HTTP spoken outside shared/protocol's clients (add a method to HubClient or "
                                  "ScorerClient, or list a module that talks to another service in HTTP_ELSEWHERE)",
                                  offenders)
    stale = sorted(m for m in HTTP_CLIENT_MODULES | set(HTTP_ELSEWHERE)
                   if m not in product_modules() or not raw_http_uses(product_modules()[m]))
    assert not stale, _report("listed as talking HTTP, but no such module or no HTTP in it", stale)


def test_raw_http_uses_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import requests\nfrom requests.adapters import HTTPAdapter\nrequests.get('u')\n"
                    "client._request('GET', '/v1/batch')\nself.requests.labels()\nrequest = 1\n")
    assert raw_http_uses(path) == ["1: import requests", "2: from requests.adapters import ...",
                                   "3: requests.get", "4: _request(...)"]


def test_the_hub_and_the_relay_do_not_import_each_other():
    """Both read the learner session (ref_server/session.py); neither reaches into the other."""
    graph = import_graph()
    halves = {"hub": "ref_server.hub", "relay": "ref_server.relay"}
    offenders = [f"{module} -> {target}" for module, targets in sorted(graph.items())
                 for name, prefix in halves.items() if module.startswith(prefix + ".") or module == prefix
                 for other, other_prefix in halves.items() if other != name
                 for target in sorted(targets) if target == other_prefix or target.startswith(other_prefix + ".")]
    assert not offenders, _report("imports between ref_server/hub and ref_server/relay", offenders)
    assert "ref_server.session_routes" in graph["ref_server.hub.routes"] & graph["ref_server.relay.routes"]


def _loss_mask_cuts(tree: ast.AST) -> list[int]:
    """Lines of ``loss_mask[:, :width]`` (on any name ending in ``loss_mask``): the loss mask cut to a mask's width and
    applied by hand, which :func:`shared.tensors.masks.model_token_mask` does (on the mask's device)."""
    def named_loss_mask(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.endswith("loss_mask")
    return sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Subscript) and named_loss_mask(node.value)
            and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2
            and all(isinstance(e, ast.Slice) for e in node.slice.elts)
            and node.slice.elts[0].lower is None and node.slice.elts[0].upper is None
            and node.slice.elts[1].upper is not None)


def test_the_loss_mask_is_applied_in_one_place():
    """``model_token_mask(loss_mask, valid)`` (or ``completion_mask(lengths, width, loss_mask)``), not
    ``valid & loss_mask[:, :width].bool()`` written out beside it."""
    home = ROOT / "shared" / "tensors" / "masks.py"
    written = [f"{path.relative_to(ROOT)}:{line}" for path in product_modules().values() if path != home
               for line in _loss_mask_cuts(syntax_tree(path))]
    assert not written, _report("the loss mask applied by hand (use shared.tensors.masks.model_token_mask)", written)
    assert _loss_mask_cuts(ast.parse("m = v & loss_mask[:, :w].bool()\nk = mb.loss_mask[:, :3]\n"
                                     "x = loss_mask[:, 2:]\ny = other[:, :w]")) == [1, 2]


def test_the_vllm_tests_open_their_engines_in_one_place():
    """tests/vllm/conftest.py's ``served_vllm`` holds how these tests serve a model (settings and close), not a copy
    per module."""
    home = ROOT / "tests" / "vllm" / "conftest.py"
    copies = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "tests" / "vllm").glob("*.py"))
              if path != home for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "VLLMEngine"]
    assert not copies, _report("VLLMEngine built outside tests/vllm/conftest.py (use the served_vllm fixture)", copies)


def test_no_bench_script_is_over_400_lines():
    """The benchmarks keep the product's file limit (a longer one holds two things: split off its child process or
    its report)."""
    long_files = [f"{path.relative_to(ROOT)}: {lines} lines" for path in sorted((ROOT / "bench").rglob("*.py"))
                  if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long_files, _report(f"bench scripts over {MAX_FILE_LINES} lines", long_files)
