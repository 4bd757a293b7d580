"""Speed and memory of attnlab against its peers: `python -m benchmarks` from the repository root.

Not part of the installed package. ``run`` is the command and its report, ``peers`` builds each of
our models beside its peer, ``scaling`` the scaling, data-pipeline and GPU-only figures, and
``harness`` measures time and memory. Current figures: benchmarks/RESULTS.md; earlier reports:
benchmarks/history/.
"""
