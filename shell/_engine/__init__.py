"""The one fit engine (private): the fit loop, compiled calls and programs, plans,
epoch sources, owners of the trained objects, options, evaluation, placement.

Front doors (``Trainer``, ``Population``, ``scan_train``) hand it what differs; see
docs/architecture.md.
"""
