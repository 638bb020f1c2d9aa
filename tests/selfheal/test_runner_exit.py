"""`megaheal run` as a real process, leaving: Ctrl-C (SIGINT) or SIGTERM stops its job on the way out (the ranks get
SIGTERM, save and exit; SIGKILL after the grace), and while it runs a second `megaheal run` on the same run
directory is refused, naming the first. The lock itself, held by a live process and left by a dead one."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ground import kill, procfs
from ground.names import derive_name
from healer.launchers.journal import targets
from healer.runner.shutdown import RunDirBusy, RunDirLock
from tests.conftest import REPO, job_env, kill_job
from tests.support import wait_for
from wire.journal import Journal
from wire.run_paths import RunPaths

HOLD = """import sys, time
from pathlib import Path
from healer.runner.shutdown import RunDirLock
with RunDirLock(Path(sys.argv[1]), resume=False):
    print("locked", flush=True)
    time.sleep(120)
"""


def megaheal_run(run_dir: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "megaheal", "run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
            "--set", "steps=400", "--metrics-port", "-1", "--timeout-min", "8", *extra]
    return subprocess.Popen(argv, cwd=REPO, env=job_env() | {"COLUMNS": "160"}, stdin=subprocess.DEVNULL,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def training(run_dir: Path, runner: int) -> list[int] | None:
    """Once all four ranks of attempt 0 have trained a step: every process the runner started (the node agents,
    their torchrun agents, the ranks), else None."""
    entries = [e for e in _read(RunPaths(run_dir).journal) if e.get("attempt") == 0]
    ranks = [int(p) for e in entries if e["event"] == "ranks" for p in e["ranks"]]
    stepped = all((run_dir / "ranks" / f"{r}.jsonl").is_file() and (run_dir / "ranks" / f"{r}.jsonl").stat().st_size
                  for r in range(4))
    if len(set(ranks)) < 4 or not stepped:
        return None
    return sorted({*ranks, *procfs.descendants(runner)})


def _kill_left(run_dir: Path, job: str) -> None:
    """Whatever attempt 0 still runs (the runner did not stop it: the test fails), checked as the healer checks."""
    for target in targets(Journal.of(RunPaths(run_dir).journal).of_attempt(0), f"{job}-0"):
        kill.send(target, signal.SIGKILL)


def _read(path: Path) -> list[dict]:  # type: ignore[type-arg]
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_it_stops_its_job_when_interrupted_and_refuses_a_second_runner_meanwhile(tmp_path: Path) -> None:
    """Ctrl-C; SIGTERM takes the same way (test_ctrl_c_and_sigterm_ask_to_stop_and_a_second_one_to_hurry). The run
    directory has a space in its name (a job name the wire once refused: the job ran unwatched); one named after a date
    is tests/unit/test_names.py's (it became a YAML date in every rank's config)."""
    sig, dirname = signal.SIGINT, "my run"
    run_dir = tmp_path / dirname
    first = megaheal_run(run_dir, tmp_path / "first.log")
    try:
        pids = wait_for("four ranks training", lambda: training(run_dir, first.pid), timeout_s=240, every_s=0.2)
        second = subprocess.run([sys.executable, "-m", "megaheal", "run", "--config", "configs/demo.yaml",
                                 "--run-dir", str(run_dir), "--metrics-port", "-1"], cwd=REPO, env=job_env(),
                                capture_output=True, text=True, timeout=180)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"is in use by megaheal run pid {first.pid}" in second.stderr
        first.send_signal(sig)
        code = first.wait(timeout=180)
    except BaseException:
        kill_job(first)
        _kill_left(run_dir, derive_name(dirname))
        raise
    out = (tmp_path / "first.log").read_text(errors="replace")
    assert code == 128 + sig, out[-3000:]
    assert "outcome: interrupted" in out and "--take-over" in out
    # The ranks reported under the job's name: the healer had rank 3's step and loss (its live view's last frame).
    assert re.search(r"│ 3\s+│ n2\s+│ \d+\s+│ \d+\.\d{4} ", out), out[-3000:]
    left = [p for p in pids if procfs.alive(p)]
    _kill_left(run_dir, derive_name(dirname))
    assert not left, "the job's ranks, torchrun agents and node agents were all stopped"
    end = _read(RunPaths(run_dir).journal)[-1]
    assert end["event"] == "end" and end["attempt"] == 0 and end["stopped"]
    # Graceful: the ranks took their SIGTERM as a preemption, saved a final checkpoint and left with 0.
    assert end["exit_codes"] == {"n1": 0, "n2": 0}, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").is_file()


@pytest.mark.services
def test_it_refuses_a_run_directory_another_runner_holds_and_takes_a_dead_runners_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for resume in (False, True):  # a live runner is never taken over, not even by --take-over
            with pytest.raises(RunDirBusy, match=rf"is in use by megaheal run pid {holder.pid} on .*\(-c "):
                RunDirLock(tmp_path, resume).__enter__()
    finally:
        holder.kill()
        holder.wait()
    # Its holder died (SIGKILL): the kernel dropped the lock; the next runner takes it and names itself in it.
    with RunDirLock(tmp_path, resume=False) as lock:
        assert json.loads(lock.path.read_text())["pid"] != holder.pid
    # A dead runner that left an attempt unfinished: only --take-over goes on with that run.
    RunPaths(tmp_path).journal.write_text(json.dumps({"event": "start", "attempt": 3, "at": 1.0}) + "\n")
    with pytest.raises(RunDirBusy, match=r"ended without stopping attempt 3 of its job.*--take-over"):
        RunDirLock(tmp_path, resume=False).__enter__()
    with RunDirLock(tmp_path, resume=True):
        pass


@pytest.mark.unit
def test_the_lock_names_its_holder_to_its_user_only_and_never_a_urls_password(tmp_path: Path, monkeypatch) -> None:
    from healer.runner.shutdown import RunDirLock as Lock

    path = RunPaths(tmp_path).runner_lock
    path.parent.mkdir(parents=True)
    path.write_text("{}\n")
    path.chmod(0o644)  # an older runner's
    monkeypatch.setattr(sys, "argv", ["megaheal", "run", "--db", "postgresql+psycopg://me:s3cret@db:5432/runs"])
    with Lock(tmp_path, resume=False) as lock:
        assert stat.S_IMODE(lock.path.stat().st_mode) == 0o600
        held = lock.path.read_text()
    assert "s3cret" not in held and "postgresql+psycopg://me:***@db:5432/runs" in json.loads(held)["argv"]


@pytest.mark.services
def test_ctrl_c_and_sigterm_ask_to_stop_and_a_second_one_to_hurry(tmp_path: Path) -> None:
    import os

    from healer.runner.shutdown import Interrupts

    before = signal.getsignal(signal.SIGINT)
    with Interrupts() as interrupts:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on the main thread: no exception
        assert interrupts.requested() and not interrupts.hurried()
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupts.hurried() and interrupts.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is before  # put back on the way out
