"""docs/design.md's layout is the repository's: every product folder is in it, every path it names exists.

The layout is the first fenced block under "## Layout". A line starting at column 0, 2, 4... with ``name/`` names a
folder (nested by its indent under the folder above it); a line starting with ``name.py`` lists files of the folder
above it; a deeper-indented line continues the line before. Every ``name/`` or ``name.py`` (or ``a/b.py``) in a
line's text is a path relative to that line's folder."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "ref_server", "generator", "learner", "deploy", "grpo_stack")
TREE_COLUMNS = 8                     # an entry starts before this column; a continuation line after it
PATH = re.compile(r"(?<![\w/.-])((?:[a-z_][a-z0-9_]*/)*[a-z_][a-z0-9_]*(?:\.py|/))(?![\w/])")


def layout_block(text: str) -> list[str]:
    """The lines of the first fenced block after the "## Layout" heading."""
    after = text[text.index("\n## Layout\n"):]
    start = after.index("```\n") + 4
    return after[start:after.index("```", start)].splitlines()


def mentioned_paths(lines: list[str]) -> set[str]:
    """Every folder (ending in /) and file the layout names, as repository-relative paths."""
    folders: list[str] = []           # the folder of each depth of the tree, as the lines go
    context, mentioned = "", set()
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        text = line.strip()
        if not text:
            continue
        if indent < TREE_COLUMNS:
            depth = indent // 2
            assert indent % 2 == 0 and depth <= len(folders), f"layout line out of the tree: {line!r}"
            del folders[depth:]
            first, _, rest = text.partition(" ")
            parent = "".join(folders)
            if first.endswith("/"):
                folders.append(first)
                context = parent + first
                mentioned.add(context)
                text = rest
            else:
                context = parent
        mentioned.update(context + name for name in PATH.findall(text))
    return mentioned


def product_folders(root: Path) -> set[str]:
    """Folders under the product roots that hold Python modules, as ``path/``."""
    return {f"{path.parent.relative_to(root).as_posix()}/"
            for top in PRODUCT for path in (root / top).rglob("*.py") if "__pycache__" not in path.parts}


def layout_problems(text: str, root: Path) -> list[str]:
    mentioned = mentioned_paths(layout_block(text))
    missing = sorted(p for p in mentioned if not (root / p).exists() or p.endswith("/") != (root / p).is_dir())
    unmentioned = sorted(product_folders(root) - mentioned)
    return ([f"design.md's layout names {p}, which does not exist" for p in missing]
            + [f"{p} holds product code but is not in design.md's layout" for p in unmentioned])


def test_design_layout_is_the_repositorys():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert len(mentioned_paths(layout_block(text))) > 100   # the parse found the files, not an empty block
    assert layout_problems(text, ROOT) == []


def test_a_stale_or_incomplete_layout_is_found(tmp_path):
    for path in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/b.py", "pkg/new/c.py", "learner/x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    text = ("# Design\n\n## Layout\n\n```\npkg/      a.py and old.py\n  sub/    b.py (and gone/)\n  a.py sub/b.py\n"
            "learner/  x.py\n```\n")
    problems = layout_problems(text, tmp_path)
    # pkg/ is no product root here: only learner/ is searched, and it is mentioned
    assert problems == ["design.md's layout names pkg/old.py, which does not exist",
                        "design.md's layout names pkg/sub/gone/, which does not exist"]
    (tmp_path / "deploy" / "tool").mkdir(parents=True)
    (tmp_path / "deploy" / "tool" / "t.py").write_text("")
    assert layout_problems(text, tmp_path)[-1] == "deploy/tool/ holds product code but is not in design.md's layout"
