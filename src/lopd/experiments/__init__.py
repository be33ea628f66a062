"""Experiments of the paper as functions behind `lopd` commands: one module per experiment
(``compare``, ``sweep``, ``ablation``, ``method_table``, ``quickstart`` and the controlled
experiments of ``lopd experiment``), ``common`` for what several share, ``runs`` for training or
reusing a run. Some import the trainer and pipeline inside their functions, so that the CLI loads
only the experiment it runs (downward imports; docs/layout.md).
"""
