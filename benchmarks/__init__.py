"""Speed and memory of attnlab against its peers: `python -m benchmarks` from the repository root.

Not part of the installed package. ``run`` is the command (its options and the report's frame), ``cases``
what each section measures, ``sections`` the sections beyond a table of cases, ``measure`` one case timed,
profiled and its memory probed, ``report`` the tables and texts; ``peers`` builds each of our models beside
its peer (a module per subject), ``scaling`` the scaling and GPU-only figures, ``data_pipeline`` the data
section, and ``harness`` measures time and memory. ``overhead`` (`python -m benchmarks.overhead`) times
`attnlab fit` against a plain loop. Current figures: benchmarks/RESULTS.md; earlier reports:
benchmarks/history/.
"""
