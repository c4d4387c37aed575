"""Installs the ``tower`` and ``tf1_syncbn`` packages.

TensorFlow itself is not in ``install_requires``: pip would otherwise install
the ``tensorflow`` distribution next to an existing ``tensorflow-cpu`` (or a
vendor build), which breaks both. Pick a build with an extra, or bring your own:

    pip install .[cpu]      # tensorflow-cpu
    pip install .[gpu]      # tensorflow[and-cuda]
    pip install .           # use the TensorFlow that is already installed
"""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _readme():
    path = os.path.join(HERE, 'README.md')
    if not os.path.exists(path):
        return ''
    with open(path, encoding='utf-8') as f:
        return f.read()


setup(
    name='tf1-syncbn',
    version='0.1.0',
    description='Synchronized Batch Normalization for TF1-style multi-tower graphs',
    long_description=_readme(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['tower', 'tower.*', 'tf1_syncbn', 'tf1_syncbn.*']),
    # The CPU kernels are compiled from source against the installed TF on first use.
    package_data={'tf1_syncbn': ['kernels/*.cc']},
    license='Apache-2.0',
    python_requires='>=3.9',
    install_requires=[
        'numpy',
        'tf-slim>=1.1.0',
    ],
    extras_require={
        'cpu': ['tensorflow-cpu>=2.13'],
        'gpu': ['tensorflow[and-cuda]>=2.13'],
        'horovod': ['horovod'],
        'demo': ['scikit-learn', 'matplotlib', 'tqdm'],
        # tf-keras (needed by the tensorpack/tf-slim reference tests) is not
        # listed: it depends on the full ``tensorflow`` distribution. The
        # Makefile installs it with --no-deps, pinned to the installed TF.
        # pytest-timeout: pytest.ini's per-test limit (a hang fails the run).
        'test': ['pytest', 'pytest-timeout>=2.1', 'tensorpack==0.11', 'scikit-learn',
                 'matplotlib', 'tqdm'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
