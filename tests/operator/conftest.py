"""Fixtures of the operator tests; the helpers live in operator_support.py.

(A module named ``conftest`` exists in several test folders; importing helpers from it picks
whichever loaded first, so tests import ``operator_support`` instead.)
"""

from operator_support import cluster, helm, operator  # noqa: F401
