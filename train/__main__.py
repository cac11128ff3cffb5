"""`deepspeed --num_gpus N --module eagle3.train ...` (same arguments as `eagle3 train`)."""
import sys

from eagle3.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]], process_entry=True)
