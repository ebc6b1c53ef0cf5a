"""The docs name what the tree holds: every path in README's layout exists, and every `Class.member` that
README.md or ARCHITECTURE.md names is defined on that class (a stale name fails here, not in a reader's hands)."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "blend", "common", "retrieval", "store")
DOCS = ("README.md", "ARCHITECTURE.md")


def layout_paths() -> list[str]:
    """The paths README's layout block names: `dir/` lines, and `  name.ext` lines under the last dir."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    paths, folder = [], None
    for line in block.splitlines():
        top = re.match(r"^([a-z_]+/)\s", line + " ")
        entry = re.match(r"^  ([a-zA-Z_][\w./]*\.(?:py|cpp|sh|yaml|md))\s", line + " ")
        if top:
            folder = top.group(1)
            paths.append(folder)
        elif entry and folder:
            paths.append(folder + entry.group(1))
    return paths


def test_the_layout_block_is_read() -> None:
    paths = layout_paths()
    assert "app/engine/rag_engine.py" in paths and "blend/" in paths and len(paths) > 40


@pytest.mark.parametrize("path", layout_paths())
def test_every_layout_path_exists(path: str) -> None:
    assert (ROOT / path).exists(), f"README's layout names {path}, which the tree lacks"


@functools.cache
def class_members() -> dict[str, set[str]]:
    """Every class in the packages → the names defined on it (methods, fields, class attributes, self.x)."""
    members: dict[str, set[str]] = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = members.setdefault(node.name, set())
                    names.update(_defined(node))
    return members


def _defined(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


PEERS = ("nanochat", "gpt-fast", "LMCache", "CacheBlend", "vLLM", "SGLang")  # a line naming one quotes its code


def named_members() -> list[tuple[str, str, str]]:
    found = set()
    for doc in DOCS:
        for line in (ROOT / doc).read_text().splitlines():
            if not any(peer in line for peer in PEERS):
                found.update((doc, cls, member) for cls, member in
                             re.findall(r"\b([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)\b", line))
    return sorted(found)


def test_the_docs_name_members() -> None:
    assert any(cls == "Runner" for _, cls, _ in named_members())


@pytest.mark.parametrize("doc,cls,member", named_members())
def test_every_named_member_exists(doc: str, cls: str, member: str) -> None:
    members = class_members()
    if cls not in members:
        pytest.skip(f"{cls} is not a class of ours (a file name, a library)")
    assert member in members[cls], f"{doc} names {cls}.{member}, which {cls} does not define"


def test_every_module_is_in_the_layout() -> None:
    named = set(layout_paths())
    modules = {file.relative_to(ROOT).as_posix() for package in PACKAGES for file in (ROOT / package).rglob("*.py")
               if file.name != "__init__.py"}
    assert sorted(modules - named) == []
