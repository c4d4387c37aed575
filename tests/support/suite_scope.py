"""How much of a cross-product of cases a run covers: ``make test`` or ``make test-full``.

Some parametrized tests run a product of options (networks, option
combinations, harness variants) where a smaller set of cases covers every
code path the product does. ``make test`` runs that covering set;
``make test-full`` (``$TF1_SYNCBN_TEST_FULL=1``) runs the whole product, in
both TF behaviours. Each use names, next to its covering set, why the cases
left out of it are covered (``docs/testing.md`` lists them).
"""

import os

#: Set to ``1`` (``make test-full``) to run every case of every product.
VARIABLE = 'TF1_SYNCBN_TEST_FULL'


def full():
    """Whether this run is ``make test-full``'s."""
    return os.environ.get(VARIABLE, '0').strip() == '1'


def covering(cases, covering_cases):
    """The cases of a product this run takes: all of them in ``make test-full``.

    Args:
      cases: the whole product.
      covering_cases: the cases ``make test`` runs, a subset of ``cases`` that
        reaches every code path the product reaches.

    Returns:
      A list: ``cases`` in ``make test-full``, else ``covering_cases``.

    Raises:
      ValueError: when ``covering_cases`` holds a case that ``cases`` does not.
    """
    cases, covering_cases = list(cases), list(covering_cases)
    strangers = [c for c in covering_cases if c not in cases]
    if strangers:
        raise ValueError('covering: cases %r are not in the product.' % (strangers,))
    return cases if full() else covering_cases
