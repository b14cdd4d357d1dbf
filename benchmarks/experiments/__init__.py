"""One-off experiments: each measured once to decide something (a default, a layout, where a message's
time goes) and kept to be rerun by hand (``python -m benchmarks.experiments.NAME``); not part of the
regression set that ``nox -s bench`` runs. Their results, where they write any, go to
benchmarks/results/ like the benchmarks'."""
