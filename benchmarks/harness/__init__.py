"""The benchmark harness: ``train.py`` (a torchrun program), ``launch``, ``netns``, ``report``,
``demo``.

Not part of the installed library. Scripts in ``benchmarks/`` import it as ``harness``
(``python benchmarks/bench_x.py`` puts ``benchmarks/`` on ``sys.path``); to run a module
directly: ``PYTHONPATH=benchmarks python -m harness.demo``.
"""
