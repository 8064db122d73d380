"""A worker that does nothing for a long time, as a rank between steps: it follows its parent as
every `setdiff` worker does (cli.main, the serving replicas), and says it is up (one write, so
the lines of two workers never interleave)."""

import os
import time

from setdiff_megatron.distributed.child_processes import follow_parent

if __name__ == "__main__":
    follow_parent()
    os.write(1, b"worker up\n")
    time.sleep(300)
