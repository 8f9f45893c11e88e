"""Research experiments: reproductions of a paper's own toy setups, run by ``bench/`` and checked by
the tests. None is part of the product, and no service, the simulator or the command imports them
(tests/test_layers.py keeps it so)."""
