"""`python -m prefill_worker -c CONFIG [--port P] [--router HOST:PORT]`"""

import sys

from prefill_worker.main import main

sys.exit(main())
