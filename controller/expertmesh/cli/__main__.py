import sys

from expertmesh.cli.main import main

sys.exit(main())
