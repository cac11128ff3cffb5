"""`torchrun --nproc-per-node N -m eagle3.regenerate ...` (same arguments as `eagle3 regenerate`).

The command's launcher, as dump/__main__.py and train/__main__.py are: no module imports it, so its import of the
CLI (for the parser, --config and the exit codes of `eagle3 regenerate`) makes no cycle with the CLI's import of
the stage's modules.
"""
import sys

from eagle3.cli import main

if __name__ == "__main__":
    main(["regenerate", *sys.argv[1:]], process_entry=True)
