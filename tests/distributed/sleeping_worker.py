"""A worker that does nothing for a long time, as a rank between steps: it follows its parent as
every `setdiff` worker does (cli.main, the serving replicas), and prints its pid."""

import time

from setdiff_megatron.distributed.offspring import follow_parent

if __name__ == "__main__":
    follow_parent()
    print("worker up", flush=True)
    time.sleep(300)
