"""The checkpoint directory: verification, resume choice with fallback, retention, atomic markers."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.checkpoint.disks import fill, small_disk
from train.checkpoint import catalog

pytestmark = pytest.mark.unit


def _fake_save(ckpt_dir: Path, step: int, complete: bool = True, model_hash: str = "m1") -> Path:
    path = ckpt_dir / catalog.step_dir_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (path / ".metadata").write_bytes(b"meta")
    if complete:
        catalog.write_manifest(path, {"step": step, "model_hash": model_hash})
        catalog.mark_latest(ckpt_dir, path)
    return path


def test_a_complete_save_verifies_and_is_chosen(tmp_path) -> None:
    _fake_save(tmp_path, 2)
    _fake_save(tmp_path, 4)
    choice = catalog.choose_resume(tmp_path, "m1", checksums=True)
    assert choice.checkpoint.step == 4 and choice.skipped == []
    assert catalog.read_latest(tmp_path) == "step-00000004"


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint_and_says_why(tmp_path) -> None:
    _fake_save(tmp_path, 2)
    newest = _fake_save(tmp_path, 4)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    choice = catalog.choose_resume(tmp_path, "m1")
    assert choice.checkpoint.step == 2
    assert choice.skipped == [("step-00000004", "__0_0.distcp: size 100 bytes, manifest says 1280")]


def test_same_size_corruption_is_found_only_by_checksums(tmp_path) -> None:
    _fake_save(tmp_path, 2)
    newest = _fake_save(tmp_path, 4)
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert catalog.choose_resume(tmp_path, "m1").checkpoint.step == 4
    choice = catalog.choose_resume(tmp_path, "m1", checksums=True)
    assert choice.checkpoint.step == 2 and "checksum mismatch" in choice.skipped[0][1]


def test_incomplete_and_foreign_checkpoints_are_skipped(tmp_path) -> None:
    _fake_save(tmp_path, 2)
    _fake_save(tmp_path, 4, model_hash="other")
    _fake_save(tmp_path, 6, complete=False)
    choice = catalog.choose_resume(tmp_path, "m1")
    assert choice.checkpoint.step == 2
    reasons = dict(choice.skipped)
    assert "did not complete" in reasons["step-00000006"]
    assert "saved for another model" in reasons["step-00000004"]


def test_nothing_to_resume_from_an_empty_directory(tmp_path) -> None:
    assert catalog.choose_resume(tmp_path / "none").checkpoint is None


def test_retention_keeps_the_last_k_every_mth_and_latest(tmp_path) -> None:
    for step in (2, 4, 6, 8, 10, 12):
        _fake_save(tmp_path, step)
    _fake_save(tmp_path, 3, complete=False)  # an old failed save
    _fake_save(tmp_path, 14, complete=False)  # a save in flight: never touched
    infos = catalog.list_checkpoints(tmp_path)
    victims = {p.name for p in catalog.retention_victims(infos, keep_last=2, keep_every=4, latest="step-00000012")}
    assert victims == {"step-00000002", "step-00000006", "step-00000003"}


def test_latest_marker_is_replaced_atomically_without_leftovers(tmp_path) -> None:
    catalog.atomic_write_text(tmp_path / "latest", "step-00000002\n")
    catalog.atomic_write_text(tmp_path / "latest", "step-00000004\n")
    assert (tmp_path / "latest").read_text() == "step-00000004\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_an_unreadable_manifest_makes_the_checkpoint_corrupt(tmp_path) -> None:
    path = _fake_save(tmp_path, 2)
    (path / "manifest.json").write_text("{not json")
    info = catalog.list_checkpoints(tmp_path)[0]
    assert catalog.verify(info) and info.status == "corrupt"


def test_atomic_write_text_leaves_no_temp_file_when_the_disk_is_full(tmp_path) -> None:
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        fill(disk)
        with pytest.raises(OSError) as failed:
            catalog.atomic_write_text(disk / "latest", "step-00000002\n" * 1000)
        assert failed.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["filler"], "no temp file left on the full disk"


def test_a_rollback_abandons_the_newer_checkpoints_until_their_step_is_saved_again(tmp_path) -> None:
    for step in (2, 4, 6):
        _fake_save(tmp_path, step)
    back_to = tmp_path / "step-00000002"
    assert catalog.abandon_newer(tmp_path, back_to, 2) == ["step-00000006", "step-00000004"]
    choice = catalog.choose_resume(tmp_path, "m1")
    assert choice.checkpoint.step == 2
    assert [name for name, _ in choice.skipped] == ["step-00000006", "step-00000004"]
    assert all(f"training went back to {back_to}" in why for _, why in choice.skipped)
    assert [c.status for c in catalog.list_checkpoints(tmp_path)] == ["abandoned", "abandoned", "ok"]
    # The new history saves step 4 again, into the same directory: that save is not abandoned.
    catalog.withdraw(tmp_path / "step-00000004")
    catalog.write_manifest(tmp_path / "step-00000004", {"step": 4, "model_hash": "m1"})
    assert catalog.choose_resume(tmp_path, "m1").checkpoint.step == 4
    infos = catalog.list_checkpoints(tmp_path)
    assert [p.name for p in catalog.retention_victims(infos, 3, 0, "step-00000004")] == ["step-00000006"]


@pytest.mark.parametrize(("manifest", "problem"), [
    ([1, 2], "manifest.json: expected an object, got list"),
    ({"files": [{"name": "../../etc/passwd", "size": 1}]}, "files[0]: name: expected a file name inside"),
    ({"files": [{"name": "__0_0.distcp", "size": "big"}]}, "files[0]: size: expected an integer >= 0, got big"),
    ({"step": 3, "files": []}, "step: expected 2 (the directory's), got 3"),
    ({"format": 2, "files": []}, "format: expected 1, got 2"),
])
def test_a_manifest_that_does_not_describe_its_own_files_is_a_named_problem(tmp_path, manifest, problem) -> None:
    path = _fake_save(tmp_path, 2)
    (path / "manifest.json").write_text(json.dumps(manifest))
    info = catalog.list_checkpoints(tmp_path)[0]
    assert info.status == "corrupt" and any(problem in p for p in catalog.verify(info, checksums=True))
    assert catalog.choose_resume(tmp_path).checkpoint is None
