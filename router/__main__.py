"""`python -m router -c CONFIG [--grpc-port P] [--http-port H] [--prefill ADDR]... [--decode ADDR]...`"""

import sys

from router.main import main

sys.exit(main())
