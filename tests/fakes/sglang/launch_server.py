"""`python -m sglang.launch_server` for tests: parses SGLang's launch flags, serves the fake server.

Unknown flags fail as SGLang's argparse does (`sglang serve: error: unrecognized arguments`, exit 2).
Test knobs come from the environment (see tests/fakes/sglang_server.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_server import main  # noqa: E402  (tests/fakes/sglang_server.py, next to this package)

if __name__ == "__main__":
    main(sys.argv[1:])
