"""Each front-end's page gives its signature as the code has it.

A user switching code reads the front-end's page, not the API reference: a
new argument (``group_size``, ``num_dev``, ``keep_dims``, ``training``)
that its page does not name is one the user never learns of. Before:
docs/tf-layers.md said ``sync_statistics`` and ``num_dev`` where the code
also took ``group_size``.

A page gives a signature in a Python block whose first line starts with
``# Fragment: the signatures`` (test_readme.py only compiles it): one
``def`` per documented callable, named as the callable is (a class: its
constructor's arguments, without ``self``). This test compares each with
``inspect.signature`` of the code: the parameters' names, order and kinds
(``*``, ``*args``, ``**kwargs``) and, where the page writes a literal, the
default. Every public callable of ``tf1_syncbn``, ``tf1_syncbn.layers`` and
``tf1_syncbn.keras`` that takes ``sync_statistics`` (a front-end: a layer,
a patch, ``moments``) must be documented so, on the page of ``PAGES``.
"""

import ast
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = ('tf1_syncbn', 'tf1_syncbn.layers', 'tf1_syncbn.keras')
#: The page that documents each front-end, by its public name.
PAGES = {
    'tf1_syncbn.sync_batch_norm': 'docs/slim.md',
    'tf1_syncbn.sync_arg_scope': 'docs/slim.md',
    'tf1_syncbn.convert_arg_scope': 'docs/slim.md',
    'tf1_syncbn.patch_slim': 'docs/slim.md',
    'tf1_syncbn.BatchNorm': 'docs/tensorpack.md',
    'tf1_syncbn.BatchRenorm': 'docs/tensorpack.md',
    'tf1_syncbn.patch_tensorpack': 'docs/tensorpack.md',
    'tf1_syncbn.layers.batch_normalization': 'docs/tf-layers.md',
    'tf1_syncbn.layers.BatchNormalization': 'docs/tf-layers.md',
    'tf1_syncbn.patch_tf_layers': 'docs/tf-layers.md',
    'tf1_syncbn.keras.BatchNormalization': 'docs/keras.md',
    'tf1_syncbn.keras.BatchNormalizationV1': 'docs/keras.md',
    'tf1_syncbn.keras.patch_keras': 'docs/keras.md',
    'tf1_syncbn.moments': 'docs/hand-written.md',
    'tf1_syncbn.weighted_moments': 'docs/hand-written.md',
}
MARKER = '# Fragment: the signatures'
_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)
_KINDS = {inspect.Parameter.POSITIONAL_ONLY: 'positional-only',
          inspect.Parameter.POSITIONAL_OR_KEYWORD: 'positional or keyword',
          inspect.Parameter.VAR_POSITIONAL: '*args',
          inspect.Parameter.KEYWORD_ONLY: 'keyword-only (after *)',
          inspect.Parameter.VAR_KEYWORD: '**kwargs'}


def _public(name):
    module, _, attr = name.rpartition('.')
    return getattr(importlib.import_module(module), attr)


def documented_signatures(page):
    """``{def name: (line, [(name, kind, default source or None)])}`` of a page's blocks."""
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        text = f.read()
    found = {}
    for block in _BLOCK.finditer(text):
        code = block.group(1)
        if not code.lstrip().startswith(MARKER):
            continue
        first = text.count('\n', 0, block.start(1)) + 1
        for node in ast.parse(code).body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = (first + node.lineno - 1, _parameters(node.args, code))
    return found


def _parameters(args, code):
    """A ``def``'s parameters as ``(name, kind, default source or None)``, in order."""
    P = inspect.Parameter
    positional = [(a, P.POSITIONAL_ONLY) for a in args.posonlyargs] + [
        (a, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [(a.arg, kind, d) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        params.append((args.vararg.arg, P.VAR_POSITIONAL, None))
    params += [(a.arg, P.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append((args.kwarg.arg, P.VAR_KEYWORD, None))
    return [(name, kind, None if d is None else ast.get_source_segment(code, d))
            for name, kind, d in params]


def _code_parameters(obj):
    params = list(inspect.signature(obj).parameters.values())
    if inspect.isclass(obj) and params and params[0].name == 'self':
        params = params[1:]
    return params


def signature_differences(page, line, documented, obj):
    """What the page's ``def`` says otherwise than the code, one sentence each."""
    code = _code_parameters(obj)
    names = [p.name for p in code]
    where = '%s:%d' % (page, line)
    said = [name for name, _, _ in documented]
    out = []
    for i, p in enumerate(code):
        if p.name not in said:
            out.append('%s lacks `%s` (%s%s, %s in the code): add it.' % (
                where, p.name, _KINDS[p.kind],
                '' if p.default is p.empty else ', default %r' % (p.default,),
                'after `%s`' % names[i - 1] if i else 'first'))
    for name, _, _ in documented:
        if name not in names:
            out.append('%s names `%s`, which the code does not take: remove it.' % (where, name))
    common = [name for name in said if name in names]
    if common != [name for name in names if name in said]:
        out.append('%s gives the parameters in another order than the code: %s.' % (
            where, ', '.join(names)))
    by_name = {p.name: p for p in code}
    for name, kind, default in documented:
        p = by_name.get(name)
        if p is None:
            continue
        if p.kind != kind:
            out.append('%s gives `%s` as %s; the code takes it %s.' % (
                where, name, _KINDS[kind], _KINDS[p.kind]))
        if (default is None) != (p.default is p.empty):
            out.append('%s gives `%s` %s; the code %s.' % (
                where, name, 'no default' if default is None else 'the default ' + default,
                'has none' if p.default is p.empty else 'defaults to %r' % (p.default,)))
            continue
        try:
            value = ast.literal_eval(default) if default is not None else p.empty
        except ValueError:
            continue            # an expression (an initializer): not compared
        # (By repr: a default the code wraps, as tensorpack's front-end marks
        # arguments left out, shows its value.)
        if default is not None and repr(value) != repr(p.default):
            out.append('%s gives `%s=%s`; the code defaults to %r.' % (
                where, name, default, p.default))
    return out


def _front_ends():
    names = []
    for module in MODULES:
        imported = importlib.import_module(module)
        for attr in imported.__all__:
            try:
                params = _code_parameters(getattr(imported, attr))
            except (TypeError, ValueError):         # not callable, or no signature
                continue
            if 'sync_statistics' in {p.name for p in params}:
                names.append('%s.%s' % (module, attr))
    return names


@pytest.mark.once
def test_every_front_end_has_a_page():
    missing = sorted(set(_front_ends()) - set(PAGES))
    assert not missing, (
        'front-ends without a documented signature: %s. Add each to PAGES (%s) and a '
        '`def` to its page\'s "%s" block.' % (', '.join(missing), __file__, MARKER))
    gone = sorted(set(PAGES) - set(_front_ends()))
    assert not gone, 'PAGES names %s, no longer public front-ends' % ', '.join(gone)


@pytest.mark.once
@pytest.mark.parametrize('name', sorted(PAGES), ids=lambda n: n.replace('tf1_syncbn.', ''))
def test_the_page_gives_the_signature_the_code_has(name):
    page, attr = PAGES[name], name.rpartition('.')[2]
    found = documented_signatures(page)
    assert attr in found, (
        '%s gives no signature of %s: add `def %s%s: ...` to its "%s" block.' % (
            page, name, attr, _suggested(_public(name)), MARKER))
    line, documented = found[attr]
    problems = signature_differences(page, line, documented, _public(name))
    assert not problems, '%s, the signature of %s:\n  %s' % (page, name, '\n  '.join(problems))


def _suggested(obj):
    """The code's signature as a page would write it (an object default: its class, called)."""
    params = [p if p.default is p.empty or not repr(p.default).startswith('<') else
              p.replace(default=_Source('%s()' % type(p.default).__name__))
              for p in _code_parameters(obj)]
    return str(inspect.Signature(params))


class _Source(str):
    def __repr__(self):
        return str(self)


@pytest.mark.once
def test_a_new_argument_without_docs_fails(tmp_path):
    """The check itself: a synthetic argument, and a default and a kind the page gets wrong."""
    def patch_tf_layers(sync_statistics='auto', num_dev=None, group_size=None, *,
                        new_option=False):
        del sync_statistics, num_dev, group_size, new_option
    page = tmp_path / 'page.md'
    page.write_text('```python\n%s (checked).\n'
                    "def patch_tf_layers(sync_statistics=None, num_dev=None, *, group_size=None):"
                    ' ...\n```\n' % MARKER)
    (line, documented), = documented_signatures(str(page)).values()
    assert signature_differences('page.md', line, documented, patch_tf_layers) == [
        'page.md:3 lacks `new_option` (keyword-only (after *), default False, after '
        '`group_size` in the code): add it.',
        "page.md:3 gives `sync_statistics=None`; the code defaults to 'auto'.",
        'page.md:3 gives `group_size` as keyword-only (after *); the code takes it '
        'positional or keyword.']
