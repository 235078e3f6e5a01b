"""``python -m attnlab.bench``: the fresh processes the suites start (a case's peak memory, a
block mask built from cold); people use ``attnlab bench``."""

import sys

from attnlab.bench import suites, timing

if len(sys.argv) > 1 and sys.argv[1] == "--peak-memory-child":
    timing.peak_memory_child(sys.argv[2:])
elif len(sys.argv) > 1 and sys.argv[1] == "--block-mask-child":
    suites.block_mask_child(sys.argv[2:])
else:
    print("use `attnlab bench` (see `attnlab bench --help`)", file=sys.stderr)
    sys.exit(2)
