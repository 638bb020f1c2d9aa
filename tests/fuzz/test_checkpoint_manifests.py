"""Fuzz: reading a checkpoint directory (train/checkpoint/catalog.py). Whatever a manifest, an abandoned marker or
`latest` holds, listing, verifying and choosing give a named problem or a good checkpoint, never an exception; a
checkpoint whose manifest does not describe its own files is never chosen."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

from train.checkpoint import catalog
from train.checkpoint.inspect import list_ as ckpt_list

pytestmark = pytest.mark.unit

STEP = 4
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=25)
# Names a manifest may list that are not the save's own files: outside it, the catalog's own, not regular files.
nasty_names = st.sampled_from(["../escape", "/etc/hostname", "", ".", "..", "a\0b", "manifest.json", "abandoned.json",
                               "sub", "zero", "missing", "__0_0.distcp", ".metadata"])


def real_save(root: Path) -> Path:
    """A complete save as the trainer writes one, plus traps a manifest might point at."""
    ckpt = root / catalog.step_dir_name(STEP)
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (ckpt / ".metadata").write_bytes(b"meta")
    catalog.write_manifest(ckpt, {"step": STEP, "model_hash": "m1", "layout": {"world_size": 1}})
    (ckpt / "sub").mkdir()
    (ckpt / "zero").symlink_to("/dev/zero")  # read through, a checksum would never end
    return ckpt


@st.composite
def manifests(draw) -> bytes:
    """Raw bytes, any JSON, JSON nested thousands deep, or the real manifest with one part changed."""
    kind = draw(st.sampled_from(["bytes", "json", "deep", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        return b"[" * draw(st.integers(min_value=1, max_value=200_000))
    manifest = {"format": 1, "step": STEP, "model_hash": "m1", "layout": {"world_size": 1},
                "files": [{"name": "__0_0.distcp", "size": 2048}, {"name": ".metadata", "size": 4}]}
    target = draw(st.sampled_from(["format", "step", "model_hash", "layout", "files", "entry", "name", "size"]))
    value = draw(json_values)
    if target in ("name", "size", "entry"):
        entry = manifest["files"][draw(st.integers(0, 1))]
        if target == "entry":
            manifest["files"][0] = value
        else:
            entry[target] = draw(nasty_names) if target == "name" and draw(st.booleans()) else value
    else:
        manifest[target] = value
    return json.dumps(manifest).encode()


def read_everything(ckpt_dir: Path) -> catalog.ResumeChoice:
    """Every reader a resume, the healer and the CLI use; returns what --resume auto would pick."""
    for info in catalog.list_checkpoints(ckpt_dir):
        for checksums in (False, True):
            problems = catalog.verify(info, checksums)
            assert all(isinstance(p, str) and p for p in problems)
        assert info.status in ("ok", "corrupt", "abandoned", "incomplete")
    catalog.retention_victims(catalog.list_checkpoints(ckpt_dir), 1, 2, catalog.read_latest(ckpt_dir))
    try:
        ckpt_list(ckpt_dir, checksums=True)  # `megaheal ckpt list`
    except typer.Exit:
        pass  # its way of saying "nothing there"
    return catalog.choose_resume(ckpt_dir, "m1", checksums=True)


@given(manifests())
def test_any_manifest_gives_a_named_problem_or_a_checkpoint_that_verifies(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = real_save(Path(tmp))
        (ckpt / catalog.MANIFEST).write_bytes(raw)
        choice = read_everything(Path(tmp))
        if choice.checkpoint is None:
            assert [name for name, _ in choice.skipped] == [ckpt.name] and choice.skipped[0][1]
            return
        decoded = json.loads(raw)
        assert catalog.manifest_problems(decoded, STEP) == [], "only a valid manifest is chosen"
        for entry in decoded["files"]:
            path = ckpt / entry["name"]
            assert path.parent == ckpt and path.is_file() and not path.is_symlink()
            assert path.stat().st_size == entry["size"]


@given(st.binary(max_size=200), st.binary(max_size=40))
def test_any_abandoned_marker_still_condemns_and_any_latest_is_read_safely(marker: bytes, latest: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = real_save(Path(tmp))
        (ckpt / catalog.ABANDONED).write_bytes(marker)
        (Path(tmp) / catalog.LATEST).write_bytes(latest)
        choice = read_everything(Path(tmp))
        assert choice.checkpoint is None and choice.skipped[0][1].startswith("abandoned")
        assert catalog.read_latest(Path(tmp)) in (None, latest.strip().decode("ascii", "replace"))
        assert os.listdir(tmp)  # nothing was deleted by reading
