import sys

from streaming.cli.main import main

sys.exit(main())
