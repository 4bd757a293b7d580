import sys

from experiments.sweep.main import main

sys.exit(main())
