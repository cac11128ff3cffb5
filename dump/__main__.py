"""`torchrun --nproc-per-node N -m eagle3.dump ...` (same arguments as `eagle3 dump`)."""
import sys

from eagle3.cli import main

if __name__ == "__main__":
    main(["dump", *sys.argv[1:]], process_entry=True)
