"""`make bench`: how fast and how surely the harness finds each bug, against
a plain random fuzzer, and what a step costs on every clean target.

Not a test: nothing here fails on a slow machine.  `python -m bench` writes
bench/results.json and bench/RESULTS.md.
"""
