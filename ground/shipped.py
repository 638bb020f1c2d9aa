"""The defaults megaheal ships (the configs/ folder: rules, the demo job, the simulator's cluster), found where the
package is installed, not where the command runs.

In a checkout (or an editable install) `ground/defaults/configs` is a link to the repository's configs/, so both read
the same files; a wheel carries a copy of that folder as package data of `ground` (pyproject.toml). Nothing here reads
the working directory: `megaheal run` started from a user's own project finds the shipped demo config and rules all
the same.

    from ground.shipped import shipped_config
    shipped_config("rules")           # the folder of the default rules
    shipped_config("sim/llama3-16k.yaml")
"""

from __future__ import annotations

from pathlib import Path

# NOTE: from this file, not importlib.resources: megaheal reads its defaults as real paths (they are handed to other
# processes and copied into run directories), and its wheel is installed unzipped like any wheel pip installs.
CONFIGS = Path(__file__).resolve().parent / "defaults" / "configs"
"""The shipped configs/ folder (a link to the checkout's configs/ in a checkout)."""


def shipped_config(relative: str) -> Path:
    """The shipped config file or folder at `relative` (e.g. "demo.yaml", "rules"), its links resolved (in a checkout:
    the file under configs/). FileNotFoundError naming the path and what is shipped when there is no such thing."""
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"a shipped config is named relative to configs/, got {relative!r}")
    path = CONFIGS / rel
    if not path.exists():
        shipped = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml")) if CONFIGS.is_dir() else []
        raise FileNotFoundError(f"megaheal ships no config {relative!r} (looked in {CONFIGS}; shipped: "
                                f"{', '.join(shipped) or 'nothing: this installation lacks its configs'})")
    return path.resolve()
