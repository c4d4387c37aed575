"""``public-api``: autodoc entries for the public names of a module, checked for completeness.

In a page (MyST)::

    ```{public-api} tf1_syncbn
    :names: sync_batch_norm BatchNorm
    ```

renders ``autofunction`` / ``autoclass`` / ``automodule`` for each name (all of
the module's ``__all__`` when ``:names:`` is left out; with ``:rest:``, the
names of ``__all__`` that no earlier directive of the page rendered). When the build ends,
every name in the ``__all__`` of the modules listed in ``public_api_modules``
(conf.py) must have been rendered by some page (a re-exported function,
class or module under any of its names), and every function and class
must have a docstring: anything missing is a warning, so ``make docs`` (``-W``)
fails when a public name is added without documentation.
"""

import importlib
import inspect

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

LOGGER = logging.getLogger(__name__)


def _entry(module, name):
    """reStructuredText for the autodoc directive that documents ``module.name``."""
    obj = getattr(module, name)
    target = '%s.%s' % (module.__name__, name)
    if inspect.ismodule(obj):
        return ['.. automodule:: %s' % obj.__name__, '   :members:', '']
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return ['.. autoexception:: %s' % target, '']
        if issubclass(obj, tuple):      # a namedtuple: its docstring lists the fields
            return ['.. autoclass:: %s' % target, '']
        return ['.. autoclass:: %s' % target, '   :members:', '']
    if callable(obj):
        return ['.. autofunction:: %s' % target, '']
    return ['.. autodata:: %s' % target, '   :no-value:', '']


class PublicApi(SphinxDirective):
    required_arguments = 1
    option_spec = {'names': directives.unchanged, 'rest': directives.flag}

    def run(self):
        module = importlib.import_module(self.arguments[0])
        done = _documented(self.env).setdefault(self.env.docname, set())
        if 'names' in self.options:
            names = self.options['names'].split()
        elif 'rest' in self.options:
            names = [name for name in module.__all__
                     if '%s.%s' % (module.__name__, name) not in done]
        else:
            names = list(module.__all__)
        lines = []
        if 'rest' in self.options and names:
            lines += ['.. rubric:: Other public names', '']
        for name in names:
            if not hasattr(module, name):
                LOGGER.warning('public-api: %s has no attribute %r', module.__name__, name,
                               location=self.get_location())
                continue
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
                LOGGER.warning('public-api: %s.%s has no docstring', module.__name__, name,
                               location=self.get_location())
            lines += _entry(module, name)
            done.add('%s.%s' % (module.__name__, name))
            if inspect.ismodule(obj):       # automodule :members: renders its __all__
                done.update('%s.%s' % (obj.__name__, member)
                            for member in getattr(obj, '__all__', ()))
        # autodoc's output is reStructuredText: in a MyST page it must be parsed
        # inside {eval-rst}, as MyST's documentation says for autodoc.
        fenced = ['```{eval-rst}'] + lines + ['```']
        node = nodes.container()
        nested_parse_with_titles(self.state, StringList(fenced, source=self.get_location()), node)
        return node.children


def _documented(env):
    """{docname: names documented there}, kept in the build environment."""
    if not hasattr(env, 'public_api_documented'):
        env.public_api_documented = {}
    return env.public_api_documented


def _purge(app, env, docname):
    _documented(env).pop(docname, None)


def _merge(app, env, docnames, other):
    _documented(env).update({d: names for d, names in _documented(other).items()
                             if d in docnames})


def _resolve(dotted):
    """The object a dotted ``module.name`` documented by a directive stands for, or None."""
    module_name, _, name = dotted.rpartition('.')
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


def _check(app, env):
    done = set().union(*_documented(env).values())
    # A re-exported function, class or module (tf1_syncbn.setup_cluster is
    # tf1_syncbn.distributed.setup_cluster) counts as documented under either name.
    done_objects = {id(obj) for obj in map(_resolve, done)
                    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)}
    for module_name in app.config.public_api_modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name, None)
            shared = (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj))
            if shared and id(obj) in done_objects:
                continue
            if '%s.%s' % (module_name, name) not in done:
                LOGGER.warning('public-api: %s.%s is in __all__ but on no page of the API '
                               'reference (add it to a public-api directive in docs/api/)',
                               module_name, name)


def setup(app):
    app.add_config_value('public_api_modules', [], 'env')
    app.add_directive('public-api', PublicApi)
    app.connect('env-purge-doc', _purge)
    app.connect('env-merge-info', _merge)
    app.connect('env-check-consistency', _check)
    return {'parallel_read_safe': True, 'parallel_write_safe': True}
