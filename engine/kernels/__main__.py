"""`python -m engine.kernels`: build this machine's kernels now (the setup step runs it), print where they are."""

import sys

from engine import kernels

built = kernels.load()
if built is None:
    print(f"pdserve kernels not built: {kernels.unavailable_reason()}", file=sys.stderr)
    sys.exit(1)
print(f"pdserve kernels built: {built.__file__}")
