"""The p22 puzzle's Python, apart from the library: its MAX ops over the learner's (``problems/p22``) or the
solution's (``solutions/p22``) kernels (``p22.py``), the compile-error report for a stub (``p22_diagnose.py``), and
the check that the problem and the solution differ only inside the fill-in regions (``skeleton.py``).
``scripts/p22.py`` is the runner (``poe p22``)."""
