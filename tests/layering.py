"""The import layering of megaheal's packages, as rules, and a checker over the source (the AST: every import,
at the top of a module or inside a function, relative ones resolved).

A rule names the modules it applies to by prefix and either the only project packages they may import (`only`)
or the ones they must not (`never`). docs/architecture.md explains the layers; tests/unit/test_layering.py runs
the check over the repository and proves that it catches a forbidden import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("ground", "wire", "inprocess", "megaheal", "train", "exporters", "healer", "runbooks", "dashboards", "sim",
            "testbed", "migrations")
"""The project's top-level packages (bench/ and tests/ are scripts and checks, not layers)."""

FRONT_DOORS = ("healer.runner", "healer.service", "healer.pages")
HANDS = ("healer.launchers", "healer.agent")
STAGES = ("healer.observe", "healer.detect", "healer.decide", "healer.incidents")
"""The healer's stages, in order: each may import the ones before it, never one after it, nor who carries a decision
out (the hands) or who asked (the front doors)."""
BASE = ("ground", "wire", "healer.errors")


@dataclass(frozen=True, slots=True)
class Rule:
    applies_to: str
    """A module and everything under it (`healer.detect` covers `healer.detect.crash`)."""
    why: str
    only: tuple[str, ...] | None = None
    """The project packages it may import (itself always); None: any but `never`."""
    never: tuple[str, ...] = ()


RULES = (
    Rule("ground", "the ground stands on nothing of the project", only=()),
    Rule("wire", "records that cross a process or a file are imported by both ends", only=("ground",)),
    Rule("exporters", "the node side's telemetry", only=("ground", "wire")),
    Rule("inprocess", "rank processes that outlive their generations: the trainer's and a user's", only=("ground", "wire")),
    Rule("train", "the trainer knows the telemetry it sends, nothing of the healer",
         only=("ground", "wire", "exporters", "inprocess")),
    Rule("megaheal.rank", "the public rank API any trainer imports: light, and nothing of the healer",
         only=("ground", "wire", "exporters", "inprocess", "megaheal.rank")),
    Rule("runbooks", "diagnostics run on a host, by an agent or by hand", only=("ground", "wire", "train")),
    Rule("dashboards", "dashboards as code read only the ground's tables", only=("ground", "wire")),
    Rule("healer.agent", "a node agent stands on the wire: its sidecar is handed in (healer/compose_agent.py)",
         only=("ground", "wire", "healer.agent")),
    *(Rule(stage, "a stage of the healer imports only the stages before it (observe, detect, decide, incidents)",
           only=(*BASE, *STAGES[:i], *(("runbooks",) if stage == "healer.decide" else ())))
      for i, stage in enumerate(STAGES)),
    Rule("healer.engine", "the engine acts only through its ports", never=(*HANDS, *FRONT_DOORS, "megaheal")),
    Rule("healer.ports", "the ports are the stages' own words", only=(*BASE, *STAGES)),
    Rule("healer.ledger", "the ledger reads runs and incidents", only=(*BASE, *STAGES)),
    Rule("healer.oncall", "on-call reads incidents and delivers them", never=(*HANDS, *FRONT_DOORS, "megaheal")),
    Rule("healer.launchers", "the hands carry orders out; they never call a front door",
         never=(*FRONT_DOORS, "megaheal")),
    Rule("healer.pages", "pages render the store", never=(*HANDS, "healer.runner", "healer.service", "megaheal")),
    Rule("sim", "the simulator runs the real policy, not the hands", never=(*HANDS, *FRONT_DOORS, "megaheal")),
    Rule("healer", "megaheal/cli.py is the only roof", never=("megaheal",)),
    Rule("testbed", "megaheal/cli.py is the only roof", never=("megaheal",)),
)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a project package in `path` (`module` is its dotted name)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # `from healer import agent` imports healer.agent: name each imported name that may be a module
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names] or [(node.lineno, base)]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def violations(root: Path, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Every import that breaks a rule, as 'path:line: module imports name (why)'."""
    out: list[str] = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            for line, name in imports_of(path, module):
                for rule in rules:
                    if not _within(module, rule.applies_to) or _within(name, rule.applies_to):
                        continue
                    allowed = rule.only is None or any(_within(name, p) for p in rule.only)
                    if not allowed or any(_within(name, p) for p in rule.never):
                        out.append(f"{path.relative_to(root)}:{line}: {module} imports {name} ({rule.why})")
    return out
