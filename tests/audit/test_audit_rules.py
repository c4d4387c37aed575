"""The audit's one list of rules (``tf1_syncbn.audit.rules.RULES``) over typed facts.

A rule is a function of a layer's ``LayerFacts`` (a frozen record) that
returns ``Problem`` and ``Note`` strings; adding one to the list is all a new
check takes: its findings reach the layer's row and the report, in order.
"""

import dataclasses

import pytest
import tensorflow as tf

from tf1_syncbn import audit_graph, sync_batch_norm
from tf1_syncbn.audit import facts as facts_lib
from tf1_syncbn.audit import rules

#: Behaviour-independent (the report's assembly): the TF2-behaviour pass only.
pytestmark = pytest.mark.once
tf1 = tf.compat.v1


def _graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [4, 3, 3, 2])
        y = sync_batch_norm(x, is_training=True, sync_statistics=None, scope='bn')
        train_op = tf.group(tf.reduce_sum(y), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    return graph, train_op


def test_the_rules_are_one_list_of_functions_of_the_facts():
    assert rules.RULES and all(callable(rule) and rule.__doc__ for rule in rules.RULES)
    assert dataclasses.is_dataclass(facts_lib.LayerFacts)
    assert dataclasses.fields(facts_lib.LayerFacts)[0].name == 'key'


def test_a_rule_added_to_the_list_reports_its_findings(monkeypatch):
    seen = []

    def big_batches(layer):
        seen.append(layer)
        return [rules.Problem('%s: problem from the new rule' % layer.key),
                rules.Note('%s: note from the new rule' % layer.key)]

    graph, train_op = _graph()
    assert audit_graph(graph, train_op).ok
    monkeypatch.setattr(rules, 'RULES', rules.RULES + (big_batches,))
    report = audit_graph(graph, train_op)
    assert [type(f) for f in seen] == [facts_lib.LayerFacts]
    facts = seen[0]
    assert (facts.key, facts.training_towers, facts.update_status) == ('bn', ('',), 'train_op')
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.key = 'other'
    assert report.problems == ['bn: problem from the new rule'] and not report.ok
    assert report.info[-1] == 'bn: note from the new rule'
    assert report.layers[0].problems == report.problems
    assert report.layers[0].notes == ['bn: note from the new rule']
