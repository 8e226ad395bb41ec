"""kvserve's shared plumbing: generated stubs (``kvserve.v1``), server set-up,
command-line flags, logging, health checks and the ``kvserve`` CLI.

No domain logic lives here; kvmanager, executor and gateway each own theirs.
"""

__version__ = "0.1.0"
