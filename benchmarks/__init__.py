"""mp's benchmarks, run as modules from the repository's root: ``python -m benchmarks.NAME`` (each
writes its tables to benchmarks/results/). ``nox -s bench`` runs the regression set (benchmarks/run.py);
one-off experiments live in benchmarks/experiments/, and modules whose names start with an underscore
are the benchmarks' helpers (benchmarks/models.py: the models several benchmarks share)."""
