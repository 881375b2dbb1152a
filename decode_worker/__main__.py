"""`python -m decode_worker -c CONFIG [--port P] [--kv-port K] [--router HOST:PORT]`"""

import sys

from decode_worker.main import main

sys.exit(main())
