"""The ref server's module layout: no import circles, and the server's state imports no router (routers import
the state, through ``ref_server.http``'s dependency)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_graph() -> tuple[dict[str, set[str]], set[str]]:
    """ref_server's modules -> the ref_server modules each names in an import (TYPE_CHECKING ones included), and
    the modules that define a router."""
    files = {}
    for path in (ROOT / "ref_server").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph, routers = {}, set()
    for name, path in files.items():
        source = path.read_text()
        if "APIRouter(" in source:
            routers.add(name)
        named = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                             for a in node.names)
        graph[name] = {n for n in named if n in files and n != name}
    return graph, routers


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_ref_server_has_no_import_circles():
    graph, _ = _import_graph()
    assert "ref_server.state" in graph and "ref_server.hub.intake" in graph
    assert sorted(name for name in graph if name in _reachable(graph, name)) == []


def test_the_state_imports_no_router():
    graph, routers = _import_graph()
    assert "ref_server.hub.routes" in routers and "ref_server.tool_api.tokenizer_routes" in routers
    assert sorted(_reachable(graph, "ref_server.state") & routers) == []


def test_the_hubs_two_halves_share_only_the_queue():
    graph, _ = _import_graph()
    assert "ref_server.hub.queue" in graph["ref_server.hub.intake"] & graph["ref_server.hub.leases"]
    assert "ref_server.hub.leases" not in _reachable(graph, "ref_server.hub.intake")
    assert "ref_server.hub.intake" not in _reachable(graph, "ref_server.hub.leases")


def _reaches_into_the_hub(source: str) -> list[str]:
    """``hub.intake``, ``hub.leases`` or ``hub.queue`` (on a name or attribute called ``hub``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in {"intake", "leases", "queue"}:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "hub":
                found.append(f"line {node.lineno}: hub.{node.attr}")
    return sorted(found)


def test_the_product_calls_the_hub_through_rollout_hub_only():
    """RolloutHub is the hub's one front: no product module outside it reaches into its queue or halves."""
    assert _reaches_into_the_hub("x = state.hub.leases.take(1)\ny = hub.intake\nz = self.queue") == [
        "line 1: hub.leases", "line 2: hub.intake"]
    own = ROOT / "ref_server" / "hub" / "rollout_hub.py"
    found = {str(path.relative_to(ROOT)): hits
             for folder in ("ref_server", "generator", "learner", "shared", "deploy")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if path != own and (hits := _reaches_into_the_hub(path.read_text()))}
    assert found == {}
