"""The one base of the four patches (``tf1_syncbn._frontend.patching.Patch``), on a stand-in module.

What every patch gets from it: changes undone in reverse order, once; an
``_apply`` that raises leaves nothing changed; one active patch per
exclusive kind, each kind with its own lock and list; a failed check undoes
the patch and raises ``PatchError`` naming the name and the way around; a
patch made inside ``yielding()`` (``python -m tf1_syncbn.run``'s) steps aside
for a later one of its kind and comes back once that is restored, waits
behind an active one, and waits without a deadlock when it arrives inside
another patch's ``_apply`` on the same thread.
"""

import threading
import types

import pytest

import tf1_syncbn
from tf1_syncbn._frontend.patching import ABSENT, Name, Patch, yielding

#: Behaviour-independent (no graph): the TF2-behaviour pass only.
pytestmark = pytest.mark.once


def _module():
    module = types.ModuleType('stand_in')
    module.layer, module.table = 'theirs', {'layer': 'theirs'}
    return module


class _Switch(Patch):
    api, target, instead = 'patch_stand_in', 'stand_in', 'call ours directly'

    def __init__(self, module, fail=False, names=(), value='ours', during=None):
        super().__init__()
        self.module, self.fail, self.names = module, fail, list(names)
        self.value, self.during = value, during

    def _apply(self):
        self._set(self.module, 'layer', self.value)
        self._set(self.module, 'added', 'ours', direct=True)
        self._set_item(self.module.table, 'layer', self.value)
        if self.during is not None:
            self.during()
        if self.fail:
            raise KeyError('boom')

    def user_names(self):
        return self.names


class _Other(_Switch):
    pass


def test_apply_restore_and_the_context_manager():
    module = _module()
    with _Switch(module).apply() as patch:
        assert (module.layer, module.added, module.table) == ('ours', 'ours', {'layer': 'ours'})
        assert patch.active
    assert (module.layer, module.table) == ('theirs', {'layer': 'theirs'})
    assert not hasattr(module, 'added') and not patch.active
    patch.restore()                                        # idempotent
    assert module.layer == 'theirs'


def test_an_apply_that_raises_leaves_nothing_changed_and_no_active_patch():
    module = _module()
    with pytest.raises(KeyError, match='boom'):
        _Switch(module, fail=True).apply()
    assert (module.layer, module.table) == ('theirs', {'layer': 'theirs'})
    assert not hasattr(module, 'added')
    _Switch(module).apply().restore()                      # not "already patched"


def test_one_active_patch_per_kind_each_kind_its_own_lock():
    first = _Switch(_module()).apply()
    try:
        with pytest.raises(RuntimeError, match='patch_stand_in: stand_in is already patched'):
            _Switch(_module()).apply()
        _Other(_module()).apply().restore()                 # another kind
        assert _Other._lock is not _Switch._lock is not Patch._lock
        assert isinstance(_Switch._lock, type(threading.Lock()))
    finally:
        first.restore()
    _Switch(_module()).apply().restore()


def test_a_name_that_is_not_ours_undoes_the_patch_and_raises_patch_error():
    module = _module()
    names = [Name('stand_in.layer', lambda: module.layer, lambda v: v == 'ours'),
             Name('stand_in.table', lambda: module.table['layer'], lambda v: v == 'nope'),
             Name('stand_in.gone', lambda: ABSENT, lambda v: False),
             Name('stand_in.broken', lambda: module.missing, lambda v: True)]
    with pytest.raises(tf1_syncbn.PatchError) as raised:
        _Switch(module, names=names).apply()
    message = str(raised.value)
    assert message.startswith('patch_stand_in cannot take effect here (TensorFlow ')
    assert "stand_in.table is still 'ours'" in message
    assert 'stand_in.broken is still raises AttributeError' in message
    assert 'stand_in.layer' not in message and 'stand_in.gone' not in message
    assert message.endswith('Instead, call ours directly.')
    assert (module.layer, module.table) == ('theirs', {'layer': 'theirs'})
    _Switch(module).apply().restore()                      # restored: not active


def test_a_yielding_patch_steps_aside_for_the_scripts_own_and_comes_back():
    module = _module()
    with yielding():
        runner = _Switch(module, value='runner').apply()
    assert runner.yields and runner.active and module.layer == 'runner'
    own = _Switch(module, value='own').apply()             # not "already patched"
    assert not own.yields and own.active
    assert runner.waiting and not runner.active
    assert (module.layer, module.table) == ('own', {'layer': 'own'})
    with pytest.raises(RuntimeError, match='already patched'):
        _Switch(module).apply()                            # two of the script's: refused
    own.restore()
    assert runner.active and not runner.waiting
    assert (module.layer, module.table) == ('runner', {'layer': 'runner'})
    runner.restore()
    assert (module.layer, module.table) == ('theirs', {'layer': 'theirs'})
    assert not hasattr(module, 'added')


def test_a_yielding_patch_waits_behind_an_active_one_and_can_be_dropped():
    module = _module()
    own = _Switch(module, value='own').apply()
    with yielding():
        runner = _Switch(module, value='runner').apply()
        later = _Switch(module, value='later').apply()
    assert runner.waiting and later.waiting and module.layer == 'own'
    runner.restore()                                       # stops waiting: never applies
    own.restore()
    assert later.active and module.layer == 'later'
    later.restore()
    assert module.layer == 'theirs' and not runner.active


def test_a_yielding_patch_made_inside_another_patchs_apply_waits_without_a_deadlock():
    """The script's patch_tensorpack imports tensorpack, whose import makes the runner's."""
    module, made = _module(), []

    def runner_switch():                  # runs inside _apply, with the kind's lock held
        with yielding():
            made.append(_Switch(module, value='runner').apply())

    own = _Switch(module, value='own', during=runner_switch).apply()
    runner, = made
    assert own.active and runner.waiting and module.layer == 'own'
    own.restore()
    assert runner.active and module.layer == 'runner'
    runner.restore()
    assert module.layer == 'theirs'
    with pytest.raises(RuntimeError, match='is being patched'):
        _Switch(module, during=lambda: _Switch(module).apply()).apply()
    assert module.layer == 'theirs'
