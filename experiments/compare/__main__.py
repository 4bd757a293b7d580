import sys

from experiments.compare.report import main

sys.exit(main())
