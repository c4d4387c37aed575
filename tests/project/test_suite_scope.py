"""``suite_scope.pairwise``: the covering sets ``make test`` runs of some products of cases."""

import itertools

import pytest

import suite_scope

pytestmark = pytest.mark.once(reason='pure Python, whatever the TF behaviour')


@pytest.mark.parametrize('factors', [
    [(2, 4), ('first', 'last', 'all'), ('md', 'classic'), ('custom', 'stock')],
    [(None, True, False), (2, 3, 4, 5), ('NHWC', 'NCHW')],
    [range(3), range(3), range(3), range(3)],
    [('a',), (1, 2), ('x', 'y', 'z')],
])
def test_every_pair_of_values_meets_in_a_subset_of_the_product(factors):
    cases = suite_scope.pairwise(*factors)
    product = list(itertools.product(*factors))
    assert cases == [c for c in product if c in cases], 'not a subset in the product order'
    assert len(set(cases)) == len(cases)
    for i, j in itertools.combinations(range(len(factors)), 2):
        met = {(c[i], c[j]) for c in cases}
        assert met == set(itertools.product(factors[i], factors[j])), (i, j)
    assert cases == suite_scope.pairwise(*factors), 'not deterministic'


def test_it_is_smaller_than_the_product_where_it_can_be():
    assert len(suite_scope.pairwise((2, 4), 'abc', 'xy', 'uv')) <= 8        # of 24
    assert len(suite_scope.pairwise(range(3), range(3), range(3), range(3))) <= 11   # of 81
    assert len(suite_scope.pairwise('ab', 'xy')) == 4                       # two factors: all


def test_a_factor_without_values_is_an_error():
    with pytest.raises(ValueError, match='factor 1 has no values'):
        suite_scope.pairwise((1, 2), ())


def test_pairwise_of_cases_that_are_not_a_product():
    # Some combinations do not exist (here: a 'stock' case only with 'x'): every pair
    # of values that meets in some case meets in a chosen one, and nothing else.
    product = itertools.product('abc', 'xyz', ('custom', 'stock'), (2, 4))
    cases = [c for c in product if c[2] == 'custom' or c[1] == 'x']
    chosen = suite_scope.pairwise_of(cases, lambda case: case)
    assert chosen == [c for c in cases if c in chosen], 'not a subset in the order of the cases'
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in chosen} == {(c[i], c[j]) for c in cases}, (i, j)
    assert len(chosen) < len(cases)
    assert chosen == suite_scope.pairwise_of(cases, lambda case: case), 'not deterministic'
    # Only the pairs asked for: (0, 1) alone is the 9 combinations of its two factors.
    assert len(suite_scope.pairwise_of(cases, lambda case: case, pairs=[(0, 1)])) == 9
    assert suite_scope.pairwise_of([], lambda case: case) == []
