import gc

from benchmarks.run import main

main()
gc.freeze()  # the process ends: no garbage-collector passes over what it made (as in experiments.cli.main)
