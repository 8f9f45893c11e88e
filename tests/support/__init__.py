"""What the tests share, so that no test module imports another.

A test module holds tests; whatever two of them need (the services started on 127.0.0.1, fakes of
a role, builders of inputs, parsers of the docs they check against) lives here, one copy each, and
is imported as ``support.<module>`` (``tests/conftest.py`` puts ``tests/`` on ``sys.path``).
Fixtures shared by several modules are in ``tests/conftest.py`` instead, where pytest finds them.
"""
