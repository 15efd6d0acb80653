"""No process outlives the tests:

* the processes Megatron's checkpoint writer starts (a multiprocessing manager per process,
  which a test rank's ``os._exit`` would leave running) are ended by the test ranks;
* ``.ci/run`` starts the suite under ``setsid`` and fails, keeping pytest's own failure status,
  when any process it started is still alive afterwards.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.megatron.megatron_utils import end_child_processes

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkpoint_writer_manager_is_ended():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = set(multiprocessing.active_children())
    filesystem_async.get_write_results_queue()  # what dist_checkpointing.save starts
    started = set(multiprocessing.active_children()) - before
    assert started, "Megatron's write-results queue no longer starts a manager process; update this test"
    end_child_processes()
    assert filesystem_async._results_queue is None
    assert not (set(multiprocessing.active_children()) & started)
    assert all(not p.is_alive() for p in started)


FAKE_TESTS = """#!/usr/bin/env bash
# stands in for the test suite: maybe leaves a process behind, then exits with a status
if [ "${LEAVE_PROCESS:-0}" = 1 ]; then sleep 120 & disown; fi
exit "${STATUS:-0}"
"""


@pytest.mark.parametrize("status,leave,want", [(0, False, 0), (0, True, 1), (3, False, 3), (3, True, 3)])
def test_ci_run_fails_on_a_leftover_process_and_keeps_the_test_status(tmp_path, status, leave, want):
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy2(ROOT / "scripts" / "check_leftover_processes.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "run_tests.sh").write_text(FAKE_TESTS)
    env = dict(os.environ, STATUS=str(status), LEAVE_PROCESS="1" if leave else "0", WAIT_S="1")
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == want, proc.stderr
    if leave:
        assert "error: the test run left 1 process(es) behind" in proc.stderr and "sleep 120" in proc.stderr
    else:
        assert "left" not in proc.stderr
