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
    return subset(cases, covering_cases, not full(), 'covering: cases %r are not in the product.')


def subset(cases, chosen, take_chosen, message):
    """``chosen`` if ``take_chosen``, else ``cases``: as a list (what a run of the suite takes).

    Raises:
      ValueError: ``message % (strangers,)``, when ``chosen`` holds cases
        (the strangers) that ``cases`` does not.
    """
    cases, chosen = list(cases), list(chosen)
    strangers = [c for c in chosen if c not in cases]
    if strangers:
        raise ValueError(message % (strangers,))
    return chosen if take_chosen else cases


def pairwise(*factors):
    """A covering set of a product in which every pair of values meets.

    For each two factors, every value of the one appears with every value of
    the other in at least one case (an all-pairs array). The set is built
    greedily and deterministically (the same factors give the same cases, in
    the product's order), so test ids stay stable between runs.

    Use it where what a case exercises depends on each option and on how two
    options combine, not on three at once; say so next to the use.

    Args:
      *factors: each a sequence of a factor's values, in the product's order.

    Returns:
      A list of tuples, one value per factor, a subset of
      ``itertools.product(*factors)`` in its order.

    Raises:
      ValueError: when a factor has no values.
    """
    import itertools  # noqa: PLC0415 - only the products' modules need it

    factors = [list(values) for values in factors]
    empty = [i for i, values in enumerate(factors) if not values]
    if empty:
        raise ValueError('pairwise: factor %d has no values.' % empty[0])
    product = list(itertools.product(*factors))
    if len(factors) < 3:
        return product
    pairs = list(itertools.combinations(range(len(factors)), 2))

    def pairs_of(case):
        return {(i, j, case[i], case[j]) for i, j in pairs}

    missing = set().union(*(pairs_of(case) for case in product))
    chosen = set()
    while missing:
        # The case that covers the most missing pairs; the product's first on ties.
        best = max(range(len(product)), key=lambda k: (len(pairs_of(product[k]) & missing), -k))
        chosen.add(best)
        missing -= pairs_of(product[best])
    return [product[k] for k in sorted(chosen)]


def pairwise_of(cases, factors, pairs=None):
    """A covering subset of ``cases`` in which every pair of values that meets, meets.

    :func:`pairwise` for cases that are not a whole product (some
    combinations do not exist): for each two factors, every two values that
    meet in some case of ``cases`` meet in a chosen case. Built greedily
    and deterministically (the case that covers the most pairs still
    missing, the first of ``cases`` on ties), in ``cases``' order.

    Args:
      cases: the cases, a sequence.
      factors: ``factors(case)`` gives the case's value of each factor, a tuple.
      pairs: which pairs of factors (index pairs) must meet; default every pair.

    Returns:
      A list: a subset of ``cases``, in their order.
    """
    import itertools  # noqa: PLC0415 - only the products' modules need it

    cases = list(cases)
    if not cases:
        return []
    values = [tuple(factors(case)) for case in cases]
    if pairs is None:
        pairs = list(itertools.combinations(range(len(values[0])), 2))
    covers = [{(i, j, v[i], v[j]) for i, j in pairs} for v in values]
    holders = {}
    for k, cover in enumerate(covers):
        for pair in cover:
            holders.setdefault(pair, []).append(k)
    gain = [len(cover) for cover in covers]
    chosen, missing = set(), set(holders)
    while missing:
        best = max(range(len(cases)), key=lambda k: (gain[k], -k))
        chosen.add(best)
        for pair in covers[best] & missing:
            missing.discard(pair)
            for k in holders[pair]:
                gain[k] -= 1
    return [cases[k] for k in sorted(chosen)]
