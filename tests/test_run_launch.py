"""The tests' launch helper (conftest.run_launch) reaches every process of a launch when it has to stop one."""

import os
import signal
import subprocess
import sys
import time

from conftest import descendants

# A launcher whose worker runs in a session of its own, as torch's elastic agent starts its workers.
LAUNCHER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
    "time.sleep(120)"
)


def test_descendants_finds_a_worker_that_left_the_launchers_session():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER])
    try:
        deadline = time.monotonic() + 30
        while len(found := descendants(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found[0] == launcher.pid and len(found) == 2
        assert os.getsid(found[1]) != os.getsid(launcher.pid)  # out of reach of a kill by session
    finally:
        for pid in reversed(descendants(launcher.pid)):
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
