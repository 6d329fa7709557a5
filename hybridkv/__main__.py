"""`python -m hybridkv ...` is the `hybridkv` command line."""
import sys

from hybridkv.entrypoints.cli import main

sys.exit(main())
