"""Datasets shipped with xmcbench, installed as the package ``xmcbench_datasets``.

Each sub-folder is one dataset in the raw-text layout (``{train,test}_{texts,labels}.txt.xz`` plus ids,
``stats.json`` and a ``README.md`` card). Code finds a folder with
``importlib.resources.files("xmcbench_datasets") / name``; see README.md here for the index and how to add one.
"""
