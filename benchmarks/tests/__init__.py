"""A package, so that its conftest.py and tests/conftest.py do not share the module name
``conftest`` when ``--doctest-modules`` collects both."""
