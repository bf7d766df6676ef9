import sys

from turbospark.cli import main

sys.exit(main())
