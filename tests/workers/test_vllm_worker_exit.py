"""Before the vLLM worker's process exits, multiprocessing's resource tracker has unlinked the shared memory left
registered with it (vLLM's processes register theirs) and exited: under switchyard-worker-vllm@'s KillMode=mixed,
systemd SIGKILLs whatever outlives the main process, and a killed tracker leaves its segments in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

LEAKER = """
import os
from multiprocessing import resource_tracker, shared_memory
from switchyard.workers.vllm_worker import stop_resource_tracker

shm = shared_memory.SharedMemory(create=True, size=4096)  # registered with the tracker, never unlinked
tracker = resource_tracker._resource_tracker._pid
stop_resource_tracker()
gone = True
try:
    os.kill(tracker, 0)
    gone = False
except ProcessLookupError:
    pass
print(shm.name.lstrip("/"), gone, os.path.exists("/dev/shm/" + shm.name.lstrip("/")), flush=True)
shm.close()
"""


def test_the_resource_tracker_has_cleaned_up_and_exited_before_the_worker_does() -> None:
    out = subprocess.run([sys.executable, "-c", LEAKER], capture_output=True, text=True, timeout=60, check=True)
    name, tracker_gone, segment_left = out.stdout.split()
    assert (tracker_gone, segment_left) == ("True", "False")
    assert "leaked shared_memory" in out.stderr  # the tracker's own word that it unlinked it
    assert not os.path.exists(f"/dev/shm/{name}")
