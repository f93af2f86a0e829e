from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from marinlm.utils.io import (
    JOB_FILE,
    LOCK_FILE,
    OutputInUseError,
    claim_output,
    folder_lock,
    lock_folder,
    unlock_folder,
    write_json_atomic,
)

from conftest import ROOT


def try_lock_elsewhere(folder) -> subprocess.CompletedProcess:
    code = f"from marinlm.utils.io import lock_folder; lock_folder({str(folder)!r}); print('locked')"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_one_job_at_a_time_writes_a_folder(tmp_path):
    with folder_lock(tmp_path / "out"):
        lock_folder(tmp_path / "out")  # re-entrant in the holding process: now held twice
        other = try_lock_elsewhere(tmp_path / "out")
        assert other.returncode != 0
        assert "another marinlm job is writing here (pid " in other.stderr
    assert try_lock_elsewhere(tmp_path / "out").returncode != 0  # one hold left
    unlock_folder(tmp_path / "out")
    assert try_lock_elsewhere(tmp_path / "out").stdout.strip() == "locked"


def test_a_filesystem_without_flock_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_flock(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with folder_lock(tmp_path / "out"):
        assert "cannot lock (Function not implemented)" in capsys.readouterr().out


def test_claim_output_resumes_the_same_job_and_names_a_difference(tmp_path):
    out = tmp_path / "out"
    settings = {"job": "x", "config": {"a": 1, "nested": {"b": [1, 2]}}, "inputs": [{"path": "p", "size": 3}]}
    assert claim_output(out, settings) is False  # a new job
    assert (out / JOB_FILE).is_file()
    (out / "result.txt").write_text("work")
    assert claim_output(out, settings) is True  # the same job: resume
    changed = {**settings, "config": {"a": 1, "nested": {"b": [1, 5]}}}
    with pytest.raises(OutputInUseError, match=r"\(config.nested.b\[1\]: 2 -> 5\)"):
        claim_output(out, changed)
    more = {**settings, "inputs": settings["inputs"] * 3}
    with pytest.raises(OutputInUseError, match=r"\(inputs: 1 items -> 3 items\)"):
        claim_output(out, more)
    assert (out / "result.txt").read_text() == "work"  # refusing loses nothing
    with folder_lock(out):
        assert claim_output(out, changed, restart=True) is False
        assert sorted(p.name for p in out.iterdir()) == sorted([JOB_FILE, LOCK_FILE])  # the held lock stays
    # A job that failed before writing any output leaves only its record: another job may take over.
    (tmp_path / "failed" / ".work" / "stage1").mkdir(parents=True)
    claim_output(tmp_path / "failed", settings)
    assert claim_output(tmp_path / "failed", changed) is False
    assert json.loads((tmp_path / "failed" / JOB_FILE).read_text()) == changed
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / LOCK_FILE).write_text("")  # a lock file alone is not someone's output
    assert claim_output(foreign, settings) is False
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(OutputInUseError, match=rf"notes: is not empty and has no {JOB_FILE}"):
        claim_output(tmp_path / "notes", settings)


def _square_or_fail(x: int) -> int:
    if x == 3:
        raise ValueError("task 3 is bad")
    if x == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    time.sleep(0.2)
    return x * x


@pytest.mark.slow
def test_process_map_leaves_no_worker_behind():
    """A failing task (or Ctrl-C) used to leave the spawned pool's workers running on their tasks."""
    import multiprocessing as mp

    from marinlm.utils.pool import WorkerDied, process_map

    assert sorted(process_map(_square_or_fail, [0, 1, 2], workers=2)) == [0, 1, 4]
    assert list(process_map(_square_or_fail, [2, 1], workers=1)) == [4, 1]
    with pytest.raises(ValueError, match="task 3 is bad"):
        for _ in process_map(_square_or_fail, [3, *range(10, 40)], workers=2):
            pass
    assert not mp.active_children()  # terminated and joined, not left to the garbage collector
    # A worker killed mid-task: an error at once (multiprocessing.Pool waited for its task forever).
    with pytest.raises(WorkerDied, match=r"a worker process died abruptly .* tasks unfinished"):
        for _ in process_map(_square_or_fail, [1, 4, *range(10, 20)], workers=2):
            pass
    assert not mp.active_children()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_mode_of_a_plain_write(tmp_path, umask, mode):
    """Every output (curated shards, token shards, tokenizer, checkpoint metadata) was written 0600
    through mkstemp: unreadable to the team or to workers running as another user on shared storage."""
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "out.json", {"a": 1})
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777 == mode


class _FullDisk:
    """A file object on a full disk: writes and the flush at close fail with ENOSPC, naming no file
    (as a real full disk does)."""

    closed = False

    def write(self, data):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.closed = True
        self.write(b"")


def test_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path):
    """Tokenizing or curating onto a full disk said only '[Errno 28] No space left on device', and
    left the half-written temporaries taking the space."""
    import errno

    import numpy as np

    from marinlm.dataset.tokenize import _SplitWriter
    from marinlm.utils.io import atomic_path

    with pytest.raises(OSError, match=r"No space left on device") as caught, atomic_path(tmp_path / "shard.npz") as tmp:
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.filename == str(tmp_path / "shard.npz") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []

    for ok in (True, False):
        writer = _SplitWriter(tmp_path / f"00001-{ok}.tokens", np.uint16)
        real = writer.file
        real.write(b"partial")
        real.close()
        writer.file = _FullDisk()
        with pytest.raises(OSError) as caught:
            writer.add(np.arange(4), 4)
        assert caught.value.filename == str(tmp_path / f"00001-{ok}.tokens")
        if ok:  # the close that would keep the file fails too: the error names it
            with pytest.raises(OSError, match="No space left") as caught:
                writer.close(True)
            assert caught.value.filename == str(tmp_path / f"00001-{ok}.tokens")
        else:  # a failing job's own error is the one reported
            writer.close(False)
        assert list(tmp_path.iterdir()) == []


def test_a_failed_job_deletes_its_temporaries_before_letting_go(tmp_path):
    from marinlm.utils.io import job_output

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), job_output(out, {"job": 1}):
        (out / "shards").mkdir()
        (out / "shards" / ".00002.tokens.1234.tmp").write_bytes(b"x" * 1000)  # a stopped worker's
        (out / "shards" / "00001.tokens").write_bytes(b"done")
        raise KeyboardInterrupt
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["00001.tokens"]
