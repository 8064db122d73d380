"""Two-rank worker for tests/test_cli.py: rank 1 meets a UserError while rank 0 waits for it in a
barrier, which then fails for want of its peer. Run as `setdiff` runs: through `run_reporting`."""

import sys

from setdiff_megatron.distributed import runtime
from setdiff_megatron.errors import UserError, run_reporting


def main() -> int:
    runtime.init_process_group()
    if runtime.rank() == 1:
        raise UserError("only rank 1 knows")
    runtime.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(run_reporting(main))
