"""csrc/build.py's ``exclusive_build``: a build killed halfway must not hang every later start on
torch's ``lock`` file, and two live builders of one directory still take turns."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from executor.attention.csrc_loader import csrc_build_script


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    build = csrc_build_script()
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its builder is killed
    with build.exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_killed_builder_releases_its_turn(tmp_path):
    """A builder killed while holding its turn (SIGKILL: no clean-up runs) does not block the next."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pathlib import Path\n"
        "from executor.attention.csrc_loader import csrc_build_script\n"
        "with csrc_build_script().exclusive_build(Path(sys.argv[1])):\n"
        "    Path(sys.argv[1], 'lock').write_text('')\n    print('held', flush=True)\n    time.sleep(600)\n"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with csrc_build_script().exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - started < 60


def test_live_builders_take_turns(tmp_path):
    build = csrc_build_script()
    inside, overlaps = [], []

    def builder() -> None:
        with build.exclusive_build(tmp_path):
            inside.append(1)
            overlaps.append(len(inside))
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1, 1, 1, 1]


def test_the_environments_ninja_builds_whatever_path_the_process_got():
    """A process started as .venv/bin/python without the venv on PATH (``make run``) builds with the
    environment's ninja, not none and not the system's: alternating ninja versions rebuilt every source."""
    import ninja

    script = ("import shutil\nfrom executor.attention.csrc_loader import csrc_build_script\n"
              "csrc_build_script().put_environment_ninja_first()\n"
              "csrc_build_script().put_environment_ninja_first()\n"
              "import os\nprint(shutil.which('ninja'))\nprint(os.environ['PATH'])\n")
    out = subprocess.run([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(Path(ninja.BIN_DIR) / "ninja")
    assert out[1] == f"{ninja.BIN_DIR}:/usr/bin:/bin"
