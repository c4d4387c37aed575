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
