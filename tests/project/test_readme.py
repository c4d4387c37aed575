"""Every Python block in README.md and docs/*.md runs as written, or is marked as a fragment.

A block is a fragment when its first line is a comment starting with
``# Fragment``; it must still be valid Python. Every other block is run, as
it is, in a process of its own, in the TF behaviour of the test run
(``tf_behavior``: the block's own ``disable_eager_execution()`` in v2,
``disable_v2_behavior()`` first in v1). A block that appears several times
(the README's quick start and its page) runs once. A fragment whose first
line ends with ``run after the script above in its folder.`` is a second
process of the block before it (a serving process that loads what the
script exported): it runs as written, without the TF behaviour's lines,
right after that block, in the same folder. Each process is forked from one
interpreter that has imported TensorFlow (tests/support/forked.py), as a
fresh ``python block.py`` in the block's folder would run. The README's links into
docs/, and the pages' links to each other, must name existing pages and
headings as GitHub reads them (Sphinx checks them as the site reads them:
``make docs``).
"""

import glob
import os
import re

import pytest

import forked
import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)
PAGES = ['README.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def _read(page):
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        return f.read()


def _blocks():
    """[(``page:line``, code)] for every Python block of every page."""
    blocks = []
    for page in PAGES:
        text = _read(page)
        for match in _BLOCK.finditer(text):
            line = text.count('\n', 0, match.start()) + 1
            blocks.append(('%s:%d' % (page, line), match.group(1)))
    return blocks


def _is_fragment(code):
    return code.lstrip().startswith('# Fragment')


_AFTER = 'run after the script above in its folder.'


def _is_follower(code):
    return _is_fragment(code) and code.lstrip().split('\n', 1)[0].endswith(_AFTER)


def _complete_blocks():
    """[(``page:line[, page:line ...]``, code)]: each distinct runnable block once."""
    where = {}
    for place, code in _blocks():
        if not _is_fragment(code):
            where.setdefault(code, []).append(place)
    return [(', '.join(places), code) for code, places in where.items()]


def _followers():
    """``{code of a block: code of the fragment that runs after it}``."""
    blocks = [code for _, code in _blocks()]
    return {before: code for before, code in zip(blocks, blocks[1:]) if _is_follower(code)}


COMPLETE = _complete_blocks()
# The TF1-behaviour pass runs the first block of three pages (tf_behavior.pick): the
# README's slim quick start, Keras and resuming from a meta graph. (tf.layers,
# tf.distribute, multiple workers and the custom getter run in TF1 behaviour in
# their own modules.)
V1_PAGES = ('README.md', 'docs/keras.md', 'docs/save-resume-export.md')
RUN = tf_behavior.pick(COMPLETE, [next(b for b in COMPLETE if b[0].startswith(page + ':'))
                                 for page in V1_PAGES])


@pytest.mark.once      # the pages' text, whatever the TF behaviour
def test_the_pages_have_runnable_blocks_and_every_block_parses():
    assert any(place.startswith('README.md:') for place, _ in COMPLETE), \
        'README.md lost its runnable quick start'
    assert len(COMPLETE) >= 6, 'the documentation lost its runnable examples'
    for place, code in _blocks():
        compile(code, place, 'exec')
    assert any('serving_check.npz' in code for code in _followers().values()), \
        'the SavedModel serving fragment no longer runs after its export script'


def _run(script, folder):
    """Runs a script as ``python script.py`` would, forked from one TensorFlow import.

    (tests/support/forked.py: the blocks import TensorFlow first and set no
    variable it reads at import; each imports tf1_syncbn for the first time
    in its own process. Measured on the slow CI CPU: 117 s of CPU for the 17
    blocks in fresh interpreters, 36 s forked.)
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    status, stdout, stderr = forked.run_python([script], folder, env, timeout=300)
    return status, stdout[-2000:] + '\n' + stderr[-4000:]


@pytest.mark.parametrize('place,code', RUN, ids=[place for place, _ in RUN])
def test_complete_block_runs(place, code, tmp_path):
    (tmp_path / 'block.py').write_text(tf_behavior.SOURCE + code if tf_behavior.is_v1() else code)
    status, output = _run('block.py', tmp_path)
    assert status == 0, '%s failed (exit %d):\n%s' % (place, status, output)
    follower = _followers().get(code)
    if follower is not None:
        (tmp_path / 'after.py').write_text(follower)
        status, output = _run('after.py', tmp_path)
        assert status == 0, 'the fragment after %s failed (exit %d):\n%s' % (
            place, status, output)


def _slug(heading):
    """The anchor GitHub and MyST give a heading (lower case, punctuation dropped)."""
    text = re.sub(r'[^\w\- ]', '', heading.strip().lower())
    return text.replace(' ', '-')


def _anchors(page):
    text = re.sub(r'^```.*?^```', '', _read(page), flags=re.S | re.M)   # not in code blocks
    return {_slug(m.group(1)) for m in re.finditer(r'^#{1,6} (.*)$', text, re.M)}


@pytest.mark.once      # the pages' text, whatever the TF behaviour
def test_links_between_pages_name_pages_and_headings_that_exist():
    """Relative links (``page.md#heading``, ``#heading``) work on GitHub as in the site."""
    readme_links = re.findall(r'\]\(docs/', _read('README.md'))
    assert len(readme_links) >= 10, 'README.md lost its links into the documentation'
    for page in PAGES:
        for target, anchor in re.findall(r'\]\(([^)#\s:]*)(?:#([^)\s]+))?\)', _read(page)):
            linked = os.path.normpath(os.path.join(os.path.dirname(page), target)) \
                if target else page
            assert os.path.exists(os.path.join(ROOT, linked)), '%s links to missing %s' % (
                page, target)
            if anchor and linked.endswith('.md'):
                assert anchor in _anchors(linked), '%s links to %s#%s: no such heading' % (
                    page, linked, anchor)
