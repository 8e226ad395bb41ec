"""csrc/build.py's cache of the CPU kernels: a build is known by the bytes it compiled, not by file
times, so a fresh checkout of the same sources (newer times on every file) loads the cached
library instead of building it again, and any changed byte or flag builds anew."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from executor.attention.csrc_loader import csrc_build_script


def test_a_build_is_known_by_its_inputs_bytes_and_settings_not_their_times(tmp_path):
    build = csrc_build_script()
    source, header = tmp_path / "a.cpp", tmp_path / "b.h"
    source.write_text("int f() { return 1; }\n")
    header.write_text("#pragma once\n")
    digest = build.inputs_digest([source, header], (["-O3"], "2.13.0"))
    later = time.time() + 3600
    for path in (source, header):
        os.utime(path, (later, later))  # what a fresh clone does to every file
    assert build.inputs_digest([source, header], (["-O3"], "2.13.0")) == digest
    assert build.inputs_digest([source, header], (["-O2"], "2.13.0")) != digest
    header.write_text("#pragma once\n// one more line\n")
    assert build.inputs_digest([source, header], (["-O3"], "2.13.0")) != digest


def test_a_cached_library_counts_only_with_a_stamp_of_the_same_inputs(tmp_path):
    build = csrc_build_script()
    library = "kvserve_cpu_kernels.so"
    assert build.built_from(tmp_path, library, "abc") is None  # nothing built
    (tmp_path / library).write_bytes(b"\x7fELF")
    assert build.built_from(tmp_path, library, "abc") is None  # built by a version without stamps
    (tmp_path / build.CPU_STAMP).write_text("other")
    assert build.built_from(tmp_path, library, "abc") is None  # built from other sources or flags
    (tmp_path / build.CPU_STAMP).write_text("abc")
    assert build.built_from(tmp_path, library, "abc") == tmp_path / library


def test_the_loaded_kernels_carry_the_stamp_of_these_sources(cpu_ops):
    """The session's build (or the one it found) is stamped with the current sources' digest, and a
    new process loads it without going through torch's builder (which says so when verbose)."""
    build = csrc_build_script()
    assert build.built_from(build.cpu_build_dir(), f"{build.CPU_LIBRARY}.so", build.cpu_inputs_digest()) is not None
    done = subprocess.run([sys.executable, "-c", "from executor.attention.csrc_loader import csrc_build_script\n"
                           "ops = csrc_build_script().load_cpu(verbose=True)\nprint(hasattr(ops, 'skinny_linear'))"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("True")
    assert "Building extension" not in done.stdout + done.stderr and "ninja" not in done.stdout + done.stderr
