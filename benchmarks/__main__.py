"""``python -m benchmarks [--layer] ...``: the command line of ``benchmarks.ops.main``."""

from benchmarks.ops import main

if __name__ == "__main__":
    main()
